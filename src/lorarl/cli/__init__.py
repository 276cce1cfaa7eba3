"""The `lorarl` command line."""
