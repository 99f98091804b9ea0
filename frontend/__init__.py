"""The HTTP front end: an OpenAI-compatible API, Prometheus metrics and a live page.

It runs in its own process and is one more client of the target daemon, over the same
ZeroMQ protocol as `dflash-client`: HTTP front end -> target daemon -> draft daemon. It
keeps no model and no bookkeeping of its own; text and numbers come from the daemon.
"""
