"""`python -m lorarl.cli`: the `lorarl` command."""

from lorarl.cli.main import main

main()
