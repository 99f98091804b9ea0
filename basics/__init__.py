"""What every package here stands on and none owns: files written whole or not at all
(`files.py`), and the settings fields a daemon's command line and the docs' limits tables are
built from (`settings_fields.py`). The standard library only: it imports nothing of the project."""
