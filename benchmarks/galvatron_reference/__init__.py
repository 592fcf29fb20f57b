"""Drive the public hetu-galvatron 2.4.0 search engine as an in-run reference (issue #5).

`profiles` writes our cost inputs in Galvatron's profile JSON format, `env` builds the
throwaway virtual environment Galvatron is installed into and runs `runner.py` there.
"""
