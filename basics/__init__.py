"""What every package here stands on and none owns: files written whole or not at all
(`files.py`), an error as one line (`errors.py`), the settings fields a daemon's command line
and the docs' limits tables are built from (`settings_fields.py`), and where rebuildable files
live (`cache.py`). The standard library only: it imports nothing of the project."""
