// Mutual TLS for the simulated fleet: every simulated node presents its own client certificate,
// minted here in memory from the benchmark's CA (-tls-ca, -tls-ca-key: what `motorctl pki init`
// writes), ECDSA P-256 with the SPIFFE URI SAN spiffe://motor/node/<id> that the controller reads
// the caller's identity from (docs/security.md). Each node then has a connection of its own, as a
// real node manager does. The fleet's NodeManagerService serves a certificate for 127.0.0.1 from
// the same CA and asks the controller for its certificate.
package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	crand "crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"time"

	"google.golang.org/grpc/credentials"
)

type authority struct {
	cert *x509.Certificate
	key  crypto.Signer
	pool *x509.CertPool
}

func readPEM(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("%s holds no PEM block", path)
	}
	return block.Bytes, nil
}

func loadAuthority(certPath, keyPath string) (*authority, error) {
	der, err := readPEM(certPath)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	if der, err = readPEM(keyPath); err != nil {
		return nil, err
	}
	key, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, err
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("%s: not a signing key", keyPath)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &authority{cert: cert, key: signer, pool: pool}, nil
}

// issue mints a leaf certificate for a SPIFFE path (e.g. "node/sim-00001"), valid for a day.
func (a *authority) issue(path string, ips []net.IP) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), crand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := crand.Int(crand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	template := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Organization: []string{"Motor"}, CommonName: path},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{{Scheme: "spiffe", Host: "motor", Path: "/" + path}},
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(crand.Reader, template, a.cert, &key.PublicKey, a.key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// nodeCredentials: what simulated node `id` presents to the controller (and trusts it by).
func (a *authority) nodeCredentials(id string) (credentials.TransportCredentials, error) {
	cert, err := a.issue("node/"+id, nil)
	if err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: a.pool}), nil
}

// serverCredentials: the fleet's NodeManagerService on 127.0.0.1, callers verified by the CA.
func (a *authority) serverCredentials() (credentials.TransportCredentials, error) {
	cert, err := a.issue("node/sim-fleet", []net.IP{net.ParseIP("127.0.0.1")})
	if err != nil {
		return nil, err
	}
	return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: a.pool,
		ClientAuth: tls.RequireAndVerifyClientCert}), nil
}
