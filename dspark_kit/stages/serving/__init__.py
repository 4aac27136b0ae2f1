"""The spec server check and the serving benchmark."""
