// Test fixture: a real `idemq serve` on a free port over a fresh database.
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
/** clients/typescript */
export const packageRoot = resolve(here, "..", "..");
/** The repository root. */
export const repoRoot = resolve(packageRoot, "..", "..");

export const serverBin = process.env["IDEMQ_BIN"] ?? join(repoRoot, "target", "debug", "idemq");

/** A fresh random suffix for names, so tests never share keys, types or queues. */
export function uid(): string {
  return randomBytes(6).toString("hex");
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

export async function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      const port = typeof addr === "object" && addr ? addr.port : 0;
      srv.close(() => resolvePort(port));
    });
  });
}

const children = new Set<ChildProcess>();
process.on("exit", () => {
  for (const c of children) c.kill("SIGKILL");
});

export interface RunningServer {
  url: string;
  port: number;
  backend: "sqlite" | "postgres";
  stop(): Promise<void>;
}

/**
 * Starts `idemq serve`. The database is a fresh SQLite file, or the
 * PostgreSQL database named by IDEMQ_TEST_PG_URL (created and migrated by
 * test.sh). Throws — the test fails — when the server does not come up.
 */
export async function startServer(options: { token?: string; port?: number } = {}): Promise<RunningServer> {
  if (!existsSync(serverBin)) {
    throw new Error(`the idemq server binary is missing at ${serverBin} (set IDEMQ_BIN)`);
  }
  const port = options.port ?? (await freePort());
  const pg = process.env["IDEMQ_TEST_PG_URL"];
  let dir: string | undefined;
  let database: string;
  if (pg) {
    database = pg;
  } else {
    dir = mkdtempSync(join(tmpdir(), "idemq-ts-"));
    database = `sqlite://${join(dir, "idemq.db")}`;
  }
  const args = ["serve", "--database", database, "--listen", `127.0.0.1:${port}`];
  if (options.token) args.push("--token", options.token);
  const env = { ...process.env };
  delete env["IDEMQ_TOKEN"];
  const child = spawn(serverBin, args, { env, stdio: ["ignore", "ignore", "pipe"] });
  children.add(child);
  let stderr = "";
  child.stderr!.on("data", (d: Buffer) => {
    stderr = (stderr + d.toString()).slice(-4000);
  });
  let exited: number | null | undefined;
  const exit = new Promise<void>((r) =>
    child.once("exit", (code) => {
      exited = code;
      children.delete(child);
      r();
    }),
  );
  const url = `http://127.0.0.1:${port}`;
  const started = Date.now();
  for (;;) {
    if (exited !== undefined) throw new Error(`idemq serve exited (${exited}) before it answered: ${stderr}`);
    try {
      const res = await fetch(`${url}/healthz`);
      if (res.status === 200) break;
    } catch {
      // not listening yet
    }
    if (Date.now() - started > 30_000) {
      child.kill("SIGKILL");
      throw new Error(`idemq serve did not answer /healthz within 30 s: ${stderr}`);
    }
    await sleep(50);
  }
  return {
    url,
    port,
    backend: pg ? "postgres" : "sqlite",
    async stop() {
      if (exited === undefined) {
        child.kill("SIGTERM");
        const t = setTimeout(() => child.kill("SIGKILL"), 5_000);
        await exit;
        clearTimeout(t);
      }
      if (dir) rmSync(dir, { recursive: true, force: true });
    },
  };
}
