"""motor-router-sync: keeps one HTTP router's worker list equal to Motor's endpoints (docs/router.md)."""
