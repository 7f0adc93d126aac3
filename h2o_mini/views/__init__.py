"""What a run looks like: the recorder of what each layer keeps (record.py), behind `plot kept` (plot.py) and the
`explore` page (explorer.py with explore.html). They import the core; the core imports nothing from here."""
