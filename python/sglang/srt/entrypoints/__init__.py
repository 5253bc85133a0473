"""Entrypoints: the offline Engine (in-process) and the HTTP server."""
