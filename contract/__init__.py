"""The contract the gateway (`mesh/`) and the workers (`workers/`) share: wire messages and their
codec, the error tree, the SSE builder, etcd access, keys and enrollment, dialect names, the
routable `Worker`/`View`, and the CLI kit both sides' subcommands use. It imports nothing of the
project (tests/test_import_rules.py holds every package to its rule)."""
