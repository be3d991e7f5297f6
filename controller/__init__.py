"""Controller: holds the deployment, places engines on nodes, keeps them running."""
