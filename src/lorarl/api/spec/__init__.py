"""The LoRARLJob spec, one module per section; `job` holds the top-level spec."""
