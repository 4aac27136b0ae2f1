"""`dspark-kit init`: a commented recipe for your own verifier."""
