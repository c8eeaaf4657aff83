"""The app's extra tabs, each a `build(loaded)` to call inside app.py's gr.Tabs().

benchmark_tab   the newest speed report from bench-results/, and a quick run on the loaded backends
spotcheck_tab   a pasted or uploaded list of sentences through every loaded backend
inputs          reading that list: pasted lines or table, .txt or .tsv, every limit checked first
machine         a warning when the machine was busier than its cores while timing

Rendering only: the measuring is bench.speed.quick_run and bench.quality.spot_check.
"""
