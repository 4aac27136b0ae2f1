"""Package data, no code: the shipped tiny verifier (tiny_verifier/: weights, tokenizer, chat
template, build record) and the word list (words.txt) its corpus is made from.

Imports nothing: data only, read by data/tiny_verifier.py and data/tiny_corpus.py.
"""
