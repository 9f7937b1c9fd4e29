"""rnncc's command line (installed as the ``rnncc`` console script)."""
