"""The Helm chart and kustomize overlays."""
