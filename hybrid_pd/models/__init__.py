"""The models hybrid-pd ships, and how they are made.

- ``hybrid-pd-tiny/``: the embedded default model (package data), a small NemotronH
  hybrid trained on synthetic GSM8K-format word problems; see its README.md.
- :mod:`.train`: the script that trains it (``python -m hybrid_pd.models.train``).
"""
