"""The meridian command-line client."""
