"""Node manager: launches and supervises engine servers on one host."""
