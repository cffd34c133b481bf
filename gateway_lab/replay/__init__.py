"""Traces: replay (through the shipped routing engine on the virtual clock, or over HTTP) and recording."""
