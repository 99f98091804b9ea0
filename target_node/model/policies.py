"""The ways a verify is rolled back in a recurrent (linear-attention, state-space) layer, by
name: the --cache-policy flag's choices, with no torch to load (target_node/model/recurrent.py
does the work)."""

CAPTURE, REPLAY = "capture", "replay"

# Replay is the default: faster in 11 of 12 family x acceptance cells of benchmarks.bench_rollback,
# since capture gives up the mixers' chunked kernels on every verify, accepted or not.
DEFAULT_RECURRENT = REPLAY
RECURRENT_POLICIES = (REPLAY, CAPTURE)
