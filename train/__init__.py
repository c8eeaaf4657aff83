"""Train the small English→Chinese Marian model shipped in assets/.

`python -m train --out assets/marian-en-zh-small` reproduces it from data/ (train.tsv.gz, dev.tsv).
"""
