"""What running jobs report: status, progress, samples and the local run record."""
