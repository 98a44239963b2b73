from mpfused.optim.adamw import Adam, AdamW  # noqa: F401
