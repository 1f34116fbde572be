# Recipes are entry points, not a library: nothing in mmprm may import them.
raise ImportError("recipes are scripts: run them with `python recipes/NAME.py` or `accelerate launch`")
