"""Running the README's shell blocks as a newcomer types them, against a real cluster."""
