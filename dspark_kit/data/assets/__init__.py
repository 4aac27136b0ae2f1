"""Package data, no code: the shipped tiny verifier (tiny_verifier/: weights, tokenizer, chat
template, build record) and the word list (words.txt) its corpus is made from. Imports nothing."""
