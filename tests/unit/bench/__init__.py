"""bench/: results files, renderers and figures."""
