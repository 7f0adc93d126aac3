"""The tools beside the core: the naive reference and check-policy's kit (naive.py, checkkit.py), the recorder
behind `plot kept` and `explore` (record.py, plot.py, explorer.py with explore.html), and bench (benchmark.py).
They import the core; the core imports nothing from here."""
