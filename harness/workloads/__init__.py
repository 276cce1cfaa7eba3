"""What small test jobs run: tiny and pretrained models, the letter task, verl-format data."""
