// The README's examples, run as written against a real server.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import ts from "typescript";
import { Client } from "idemq";
import { type RunningServer, packageRoot, startServer } from "./server.js";

let server: RunningServer;
const dir = join(packageRoot, "build", "readme");
const blocks = [...readFileSync(join(packageRoot, "README.md"), "utf8").matchAll(/```(js|ts)\n([\s\S]*?)```/g)].map((m) => ({
  lang: m[1]!,
  code: m[2]!,
}));

before(async () => {
  server = await startServer();
  mkdirSync(dir, { recursive: true });
});
after(async () => {
  await server?.stop();
});

/** Starts a module file with node: `done` resolves with its exit code and output. */
function start(file: string) {
  const child = spawn(process.execPath, [file], { env: { ...process.env, IDEMQ_URL: server.url }, cwd: dir });
  let stdout = "";
  let stderr = "";
  child.stdout.on("data", (d: Buffer) => (stdout += d.toString()));
  child.stderr.on("data", (d: Buffer) => (stderr += d.toString()));
  const timer = setTimeout(() => child.kill("SIGKILL"), 30_000);
  const done = new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) =>
    child.on("exit", (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    }),
  );
  return { child, done };
}

const run = (file: string) => start(file).done;

test("the README has its four examples", () => {
  assert.deepEqual(
    blocks.map((b) => b.lang),
    ["js", "js", "ts", "ts"],
  );
});

function typeCheck(files: string[]): string[] {
  const program = ts.createProgram(files, {
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
    target: ts.ScriptTarget.ES2022,
    strict: true,
    noEmit: true,
    types: ["node"],
    skipLibCheck: true,
  });
  return ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
}

test("the quick start enqueues, replays and catches the conflict", async () => {
  const file = join(dir, "quickstart.mjs");
  writeFileSync(file, blocks[0]!.code);
  const r = await run(file);
  assert.equal(r.code, 0, r.stderr);
  assert.match(r.stdout, /^accepted replayed true$/m);
  assert.match(r.stdout, /^true \[ 'payload' \] capture…$/m);
});

test("the worker example runs the job and stops on SIGTERM", async () => {
  const client = new Client({ baseUrl: server.url });
  const binding = await client.idempotencyLookup("capture:inv_42", { scope: "invoice-capture" });
  assert.ok(binding, "the quick start ran first");
  const file = join(dir, "worker.mjs");
  writeFileSync(file, blocks[1]!.code);
  const worker = start(file);
  const job = await client.waitForJob(binding.jobId, { timeoutMs: 20_000 });
  assert.equal(job.state, "completed");
  assert.deepEqual(job.result, { captured: "inv_42", chargeId: `ch_${job.id}` });
  worker.child.kill("SIGTERM"); // as a terminal's Ctrl-C or a service manager would
  const r = await worker.done;
  assert.equal(r.code, 0, r.stderr);
  assert.match(r.stdout, /completed: 1/);
});

test("the TypeScript example type-checks and runs", async () => {
  const file = join(dir, "narrowing.mts");
  writeFileSync(file, blocks[2]!.code);
  assert.deepEqual(typeCheck([file]), []);
  const js = ts.transpileModule(blocks[2]!.code, {
    compilerOptions: { module: ts.ModuleKind.ESNext, target: ts.ScriptTarget.ES2022 },
  }).outputText;
  const out = join(dir, "narrowing.mjs");
  writeFileSync(out, js);
  const r = await run(out);
  assert.equal(r.code, 0, r.stderr);
  assert.equal(r.stdout.trim(), "accepted");
});

test("a typed handler type-checks and fits the worker", () => {
  const file = join(dir, "typed.mts");
  writeFileSync(file, blocks[3]!.code);
  const use = join(dir, "typed-use.mts");
  writeFileSync(
    use,
    [
      'import { Client, Worker } from "idemq";',
      'import { capture } from "./typed.mjs";',
      'new Worker(new Client({ baseUrl: "http://127.0.0.1:1" }), { handlers: { "invoice.capture": capture } });',
      "",
    ].join("\n"),
  );
  assert.deepEqual(typeCheck([file, use]), []);
});
