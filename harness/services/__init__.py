"""The places a person reads a run (browser, MLflow, W&B, the status API) and checks of them."""
