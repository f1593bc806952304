"""Fakes of external engines (ATOM, SGLang) for tests. Each cites the repository, file and commit it
mirrors and answers as that code does (docs/design.md item 17); where a real engine runs here (vLLM on the
CPU), tests use the engine itself instead."""
