"""One folder per drafting method (registry.py lists them and what each brings)."""
