"""The app's tabs, each a `build(loaded)` to call inside app.py's gr.Tabs().

compare_tab      one text through every backend: panels, divergence, drift, latency; the `compare` API
compare_render   the Compare tab's HTML, from the `compare` JSON; backend labels and colours
compare_figures  the Compare tab's latency table and figures
locate_render    the "locate" report's table and chart
benchmark_tab    the newest speed report from bench-results/, and a quick run on the loaded backends
spotcheck_tab    a pasted or uploaded list of sentences through every loaded backend
state            `Loaded`: what app.py prepared (backends, load errors, limits, examples)
machine          a warning when the machine was busier than its cores while timing

Layout, events and rendering only: the work is the request layer's (`service/`).
"""
