/** A server with API keys and TLS: refused without a key, roles enforced, TLS with a CA. */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { Client, PermissionDenied, Unauthenticated, Unavailable } from "../src/index.js";
import { ServerProcess, python, queueName } from "./server.js";

// The server asks for a bootstrap token as strong as a key: 32 random bytes.
const ADMIN = randomBytes(32).toString("base64url");
let certs: string;
let server: ServerProcess;
let ca: string;

before(async () => {
  certs = mkdtempSync(join(tmpdir(), "querator-ts-certs-"));
  await python("import sys, querator.testing as t; t.make_certificates(sys.argv[1])", [certs]);
  ca = readFileSync(join(certs, "ca.pem"), "utf8");
  server = await ServerProcess.start({
    args: ["--auth", "--tls-cert", join(certs, "server.pem"), "--tls-key", join(certs, "server.key")],
    env: { QUERATOR_ADMIN_TOKEN: ADMIN },
    probe: { tls: { ca } },
  });
});

after(async () => {
  await server?.stop();
  if (certs) rmSync(certs, { recursive: true, force: true });
});

test("a call without a key, or with an unknown one, is refused", async () => {
  const anonymous = new Client({ address: server.address, tls: { ca } });
  const wrong = new Client({ address: server.address, tls: { ca }, bearerToken: "not-a-key" });
  try {
    await assert.rejects(anonymous.createQueue(queueName()), (e: unknown) => e instanceof Unauthenticated && e.status === "UNAUTHENTICATED");
    await assert.rejects(anonymous.listQueues().toArray(), Unauthenticated);
    await assert.rejects(wrong.produce("anything", "x"), Unauthenticated);
  } finally {
    anonymous.close();
    wrong.close();
  }
});

test("keys: the admin token creates a producer key, which may produce but not lease; a revoked key is refused", async () => {
  const admin = new Client({ address: server.address, tls: { ca }, bearerToken: ADMIN });
  const q = queueName("orders");
  await admin.createQueue(q);
  const created = await admin.createKey("producer", [`${q}*`], { description: "ts test" });
  assert.equal(created.key.role, "producer");
  assert.deepEqual(created.key.queues, [`${q}*`]);
  assert.ok(created.token.length > 10);
  assert.ok((await admin.listKeys()).some((k) => k.keyId === created.key.keyId));

  const producer = new Client({ address: server.address, tls: { ca }, bearerToken: created.token });
  try {
    const result = await producer.produce(q, ["allowed"]);
    assert.equal(result.ids.length, 1);
    await assert.rejects(producer.lease(q, { waitMs: 0 }), PermissionDenied);
    await admin.revokeKey(created.key.keyId);
    await assert.rejects(producer.produce(q, "after revoke"), Unauthenticated);
    assert.equal((await admin.queueStats(q)).total, 1);
  } finally {
    producer.close();
    admin.close();
  }
});

test("a key whose role may never use a stream gets PermissionDenied at once, again on the next request", async () => {
  const admin = new Client({ address: server.address, tls: { ca }, bearerToken: ADMIN });
  const q = queueName("roles");
  await admin.createQueue(q);
  const producerKey = await admin.createKey("producer", [q]);
  const consumerKey = await admin.createKey("consumer", [q]);
  // The server ends such a stream as it opens: the request fails, neither retried nor hung.
  const producer = new Client({ address: server.address, tls: { ca }, bearerToken: producerKey.token, timeoutMs: 20_000 });
  const consumer = new Client({ address: server.address, tls: { ca }, bearerToken: consumerKey.token, timeoutMs: 20_000 });
  try {
    assert.equal((await producer.produce(q, ["a"])).ids.length, 1);
    for (let i = 0; i < 2; i++) {
      const started = performance.now();
      await assert.rejects(
        producer.lease(q, { waitMs: 5_000 }),
        (e: unknown) => e instanceof PermissionDenied && e.rawMessage === `key ${producerKey.key.keyId} (producer) may not consume`,
      );
      assert.ok(performance.now() - started < 4_000, "refused at once, not after the wait or the timeout");
    }
    await assert.rejects(
      consumer.produce(q, ["b"]),
      (e: unknown) => e instanceof PermissionDenied && e.rawMessage === `key ${consumerKey.key.keyId} (consumer) may not produce`,
    );
    assert.deepEqual((await consumer.lease(q, { waitMs: 0 })).map((item) => new TextDecoder().decode(item.payload)), ["a"]);
  } finally {
    producer.close();
    consumer.close();
    admin.close();
  }
});

test("TLS: a client that does not trust the server's CA cannot connect", async () => {
  const untrusting = new Client({ address: server.address, tls: true, bearerToken: ADMIN, retries: 0 });
  const plaintext = new Client({ address: server.address, bearerToken: ADMIN, retries: 0, timeoutMs: 3000 });
  try {
    await assert.rejects(untrusting.getQueue("x"), Unavailable);
    await assert.rejects(plaintext.getQueue("x"), Unavailable);
  } finally {
    untrusting.close();
    plaintext.close();
  }
});

test("mutual TLS: a client certificate signed by the server's client CA is let in, none is refused", async () => {
  const mtls = await ServerProcess.start({
    args: ["--tls-cert", join(certs, "server.pem"), "--tls-key", join(certs, "server.key"), "--tls-client-ca", join(certs, "ca.pem")],
    probe: { tls: { ca, cert: readFileSync(join(certs, "client.pem")), key: readFileSync(join(certs, "client.key")) } },
  });
  const withCert = new Client({
    address: mtls.address,
    tls: { ca, cert: readFileSync(join(certs, "client.pem")), key: readFileSync(join(certs, "client.key")) },
  });
  const withoutCert = new Client({ address: mtls.address, tls: { ca }, retries: 0, timeoutMs: 5000 });
  try {
    const q = queueName("mtls");
    await withCert.createQueue(q);
    assert.equal((await withCert.produce(q, "over mutual TLS")).ids.length, 1);
    await assert.rejects(withoutCert.getQueue(q), Unavailable);
  } finally {
    withCert.close();
    withoutCert.close();
    await mtls.stop();
  }
});
