"""The serving engine end to end on an exported decoder (``bench``)."""
