"""Security shared by every service: mutual TLS, identities and roles, tokens, the PKI."""
