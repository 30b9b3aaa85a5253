package idemq

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// The suite runs against a real `idemq serve`, started here. It never
// skips: a server that cannot be started fails the run.
//
//	IDEMQ_BIN             the server binary (default ../../target/debug/idemq)
//	IDEMQ_GO_BACKEND      "sqlite" (default) or "postgres"
//	IDEMQ_TEST_DATABASE_URL  with postgres: a server URL; a fresh database is
//	                      created from it and dropped afterwards

var (
	shared  *testServer // the suite's server
	backend string
)

func TestMain(m *testing.M) {
	code, err := runSuite(m)
	if err != nil {
		fmt.Fprintln(os.Stderr, "idemq test setup failed:", err)
		// A failing "test" so that the summary counts it.
		fmt.Println("--- FAIL: TestSetup (0.00s)")
		os.Exit(1)
	}
	os.Exit(code)
}

func runSuite(m *testing.M) (int, error) {
	backend = os.Getenv("IDEMQ_GO_BACKEND")
	if backend == "" {
		backend = "sqlite"
	}
	var dbURL string
	switch backend {
	case "sqlite":
	case "postgres":
		base := os.Getenv("IDEMQ_TEST_DATABASE_URL")
		if base == "" {
			return 0, fmt.Errorf("IDEMQ_GO_BACKEND=postgres needs IDEMQ_TEST_DATABASE_URL")
		}
		name := "idemq_go_" + randomHex(6)
		if err := psql(base, "CREATE DATABASE "+name); err != nil {
			return 0, fmt.Errorf("creating the PostgreSQL database: %w", err)
		}
		defer func() {
			if err := psql(base, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
				fmt.Fprintln(os.Stderr, "dropping", name+":", err)
			}
		}()
		u, err := url.Parse(base)
		if err != nil {
			return 0, err
		}
		u.Path = "/" + name
		dbURL = u.String()
		if out, err := exec.Command(serverBin(), "migrate", "--database", dbURL).CombinedOutput(); err != nil {
			return 0, fmt.Errorf("idemq migrate: %v\n%s", err, out)
		}
	default:
		return 0, fmt.Errorf("unknown IDEMQ_GO_BACKEND %q", backend)
	}
	var err error
	shared, err = startServer(serverConfig{database: dbURL})
	if err != nil {
		return 0, err
	}
	defer shared.stop()
	return m.Run(), nil
}

func psql(base, sql string) error {
	out, err := exec.Command("psql", base, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql).CombinedOutput()
	if err != nil {
		return fmt.Errorf("psql %q: %v: %s", sql, err, out)
	}
	return nil
}

func serverBin() string {
	if b := os.Getenv("IDEMQ_BIN"); b != "" {
		return b
	}
	abs, _ := filepath.Abs(filepath.Join("..", "..", "target", "debug", "idemq"))
	return abs
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

type serverConfig struct {
	database string // "" = a fresh SQLite file
	token    string
	port     int // 0 = a free one
}

type testServer struct {
	url  string
	port int
	cmd  *exec.Cmd
	dir  string
	log  *lockedBuffer
	once sync.Once
}

// lockedBuffer is a bytes.Buffer the server's output can be written to
// while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Buffer.Write(p)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func startServer(cfg serverConfig) (*testServer, error) {
	bin := serverBin()
	if _, err := os.Stat(bin); err != nil {
		return nil, fmt.Errorf("the idemq server binary %s is missing (build it, or set IDEMQ_BIN): %w", bin, err)
	}
	dir, err := os.MkdirTemp("", "idemq-go-test-")
	if err != nil {
		return nil, err
	}
	db := cfg.database
	if db == "" {
		db = "sqlite://" + filepath.Join(dir, "idemq.db")
	}
	port := cfg.port
	if port == 0 {
		if port, err = freePort(); err != nil {
			return nil, err
		}
	}
	args := []string{"serve", "--database", db, "--listen", fmt.Sprintf("127.0.0.1:%d", port)}
	if cfg.token != "" {
		args = append(args, "--token", cfg.token)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "IDEMQ_TOKEN=", "RUST_LOG=warn")
	logBuf := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logBuf, logBuf
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	s := &testServer{url: fmt.Sprintf("http://127.0.0.1:%d", port), port: port, cmd: cmd, dir: dir, log: logBuf}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			os.RemoveAll(dir)
			logBuf.mu.Lock()
			defer logBuf.mu.Unlock()
			return nil, fmt.Errorf("idemq serve exited before it was healthy: %v\n%s", err, logBuf.String())
		default:
		}
		resp, err := http.Get(s.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-exited
			os.RemoveAll(dir)
			return nil, fmt.Errorf("idemq serve did not answer /healthz within 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.cmd = cmd
	go func() { <-exited }()
	return s, nil
}

func (s *testServer) stop() {
	s.once.Do(func() {
		_ = s.cmd.Process.Kill()
		time.Sleep(20 * time.Millisecond)
		os.RemoveAll(s.dir)
	})
}

// client returns a client of the shared server.
func newTestClient(opts ...Option) *Client { return NewClient(shared.url, opts...) }

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// uniq returns a name unique to this run, for job types, queues and keys.
func uniq(prefix string) string { return prefix + "-" + randomHex(5) }

func mustNoRawKey(t *testing.T, key string, texts ...string) {
	t.Helper()
	for _, s := range texts {
		if strings.Contains(s, key) {
			t.Fatalf("the raw idempotency key appears in %q", s)
		}
	}
}

func netListen() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }
