"""What every layer shares about a runtime: its description and how it is measured.

Stdlib and numpy only, and nothing imported here at package level: the app, the exporter, the
benchmark's workers and the peers' environment (`.venv-bench`, transformers 4) all import from it.
"""
