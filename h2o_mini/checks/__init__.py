"""What a rule is checked against: the naive reference (naive.py: one row, every key and value kept, eviction as
a mask), check-policy's kit (checkkit.py: the fast paths against it), and the same inside transformers
(check_transformers.py). They import the core; the core imports nothing from here."""
