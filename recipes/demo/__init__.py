"""The demo's own code: the ground-truth evaluation and the report of `recipes/quickstart.py`.

It is imported as the package `demo`, found on sys.path through recipes/ (sys.path[0] when
quickstart runs as a script; tests add it with `recipe_runs.load_demo`). The library never imports it.
"""
