// Harness of the dashboard tests: a real `blockplane serve` on a temp data dir
// (unix socket and TCP, with a token), the CLI's `blockplane dashboard`
// port-forward to its socket, an API client over the socket, headless
// Chromium (Debian's, driven by playwright-core), and helpers to look at the
// kernel's loop devices. Needs root (loop devices).

import { spawn, execFileSync } from 'node:child_process';
import {
  closeSync, existsSync, fsyncSync, mkdtempSync, mkdirSync, openSync, readFileSync, readdirSync, rmSync, statSync, writeSync,
} from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const here = path.dirname(fileURLToPath(import.meta.url));
export const REPO = path.resolve(here, '../..');
/** The binary under test (the debug build unless BLOCKPLANE_BIN says otherwise). */
export const BIN = process.env.BLOCKPLANE_BIN || path.join(REPO, 'target/debug/blockplane');
export const SCREENSHOTS = path.join(REPO, 'target/dashboard-screenshots');
export const TOKEN = 'dashboard-test-token-3f9c';

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Waits until fn() is truthy (polling), or fails with `what` after `ms`. */
export async function until(what, fn, ms = 10000) {
  const deadline = Date.now() + ms;
  let last;
  for (;;) {
    try {
      last = await fn();
      if (last) return last;
    } catch (e) {
      last = e;
    }
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what} (last: ${last})`);
    await sleep(100);
  }
}

/** A running service, its port-forward, and a client of its API. */
export class Service {
  /** token: the service's token, or null for none (the socket's default); env: more of its environment (e.g. a test fault). */
  static async start({ token = TOKEN, env: extra = {} } = {}) {
    const s = new Service();
    s.token = token;
    s.dir = mkdtempSync('/tmp/bpdash');
    s.data = path.join(s.dir, 'data');
    s.images = path.join(s.dir, 'images');
    mkdirSync(s.images, { recursive: true });
    s.sock = path.join(s.data, 'blockplane.sock');
    s.tcpPort = await freePort();
    s.log = [];
    const env = { ...process.env, BLOCKPLANE_LOG: 'info', ...extra };
    delete env.BLOCKPLANE_TOKEN;
    const listen = ['--listen', `unix:${s.sock}`];
    // A TCP listener needs a token.
    if (token) {
      env.BLOCKPLANE_TOKEN = token;
      listen.push('--listen', `127.0.0.1:${s.tcpPort}`);
    }
    s.proc = spawn(BIN, ['serve', '--data-dir', s.data, '--image-root', s.images, ...listen],
      { env, stdio: ['ignore', 'pipe', 'pipe'] });
    s.proc.stdout.on('data', (d) => s.log.push(String(d)));
    s.proc.stderr.on('data', (d) => s.log.push(String(d)));
    await until('the service to answer /healthz', async () => (await s.call('GET', '/healthz')).status === 200, 20000);

    // The port-forward, as a user runs it: no token of its own, so the
    // browser's token passes through to the service.
    const fenv = { ...process.env };
    delete fenv.BLOCKPLANE_TOKEN;
    s.forward = spawn(BIN, ['--api', `unix:${s.sock}`, 'dashboard', '--listen', '127.0.0.1:0'],
      { env: fenv, stdio: ['ignore', 'pipe', 'pipe'] });
    s.forward.stderr.on('data', (d) => s.log.push(`forward: ${d}`));
    s.url = await new Promise((resolve, reject) => {
      let out = '';
      s.forward.stdout.on('data', (d) => {
        out += d;
        const m = /dashboard at (http:\/\/\S+)/.exec(out);
        if (m) resolve(m[1]);
      });
      s.forward.once('exit', (code) => reject(new Error(`blockplane dashboard exited ${code}: ${s.log.join('')}`)));
    });
    s.tcpUrl = `http://127.0.0.1:${s.tcpPort}/`;
    return s;
  }

  /** One API request over the unix socket, with the token: { status, body }. */
  call(method, p, body) {
    return new Promise((resolve, reject) => {
      const payload = body === undefined ? null : Buffer.from(JSON.stringify(body));
      const req = http.request({
        socketPath: this.sock,
        method,
        path: p,
        headers: {
          host: 'localhost',
          ...(this.token ? { authorization: `Bearer ${this.token}` } : {}),
          ...(payload ? { 'content-type': 'application/json', 'content-length': payload.length } : {}),
        },
      }, (res) => {
        let text = '';
        res.setEncoding('utf8');
        res.on('data', (c) => { text += c; });
        res.on('end', () => {
          let parsed = null;
          try {
            parsed = text ? JSON.parse(text) : null;
          } catch {
            parsed = text;
          }
          resolve({ status: res.statusCode, body: parsed });
        });
      });
      req.on('error', reject);
      if (payload) req.write(payload);
      req.end();
    });
  }

  async ok(method, p, body) {
    const a = await this.call(method, p, body);
    if (a.status >= 300) throw new Error(`${method} ${p} answered ${a.status}: ${JSON.stringify(a.body)}`);
    return a.body;
  }

  /** Creates a fully allocated image of `mib` MiB under the image root. */
  image(name, mib) {
    return this.ok('POST', '/v1/images', {
      name, path: path.join(this.images, `${name}.img`), create: { size_bytes: mib * 2 ** 20, allocation: 'full' },
    });
  }

  /**
   * A sparse image of `mib` MiB with `dataMib` MiB of a pattern written from
   * its start (a copy copies the data, not the holes).
   */
  async imageWithData(name, mib, dataMib) {
    const img = await this.ok('POST', '/v1/images', {
      name, path: path.join(this.images, `${name}.img`), create: { size_bytes: mib * 2 ** 20 },
    });
    const chunk = Buffer.alloc(2 ** 20, 0);
    for (let i = 0; i < chunk.length; i += 1) chunk[i] = i % 251;
    const fd = openSync(img.path, 'r+');
    try {
      for (let off = 0; off < dataMib; off += 1) writeSync(fd, chunk, 0, chunk.length, off * 2 ** 20);
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    return img;
  }

  /** A loop volume on a new image. */
  async loopVolume(name, mib, extra = {}) {
    await this.image(`${name}-img`, mib);
    return this.ok('POST', '/v1/volumes', { name, image: `${name}-img`, backend: 'loop', ...extra });
  }

  async stop() {
    try {
      const vols = await this.call('GET', '/v1/volumes');
      for (const v of vols.body || []) await this.call('DELETE', `/v1/volumes/${v.id}`);
    } catch {
      /* the service is gone already: the loop sweep below cleans up */
    }
    for (const p of [this.forward, this.proc]) {
      if (p && p.exitCode === null) {
        p.kill('SIGTERM');
        await new Promise((r) => { p.once('exit', r); setTimeout(r, 5000); });
      }
    }
    for (const dev of loopDevicesUnder(this.dir)) {
      try {
        execFileSync('losetup', ['-d', dev]);
      } catch {
        /* already gone */
      }
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** `[device, backing file]` of every bound loop device. */
export function loopDevices() {
  const out = [];
  for (const name of readdirSync('/sys/block')) {
    if (!name.startsWith('loop')) continue;
    const f = `/sys/block/${name}/loop/backing_file`;
    if (existsSync(f)) out.push([`/dev/${name}`, readFileSync(f, 'utf8').trim()]);
  }
  return out;
}

export function loopDevicesUnder(dir) {
  return loopDevices().filter(([, f]) => f.startsWith(dir)).map(([d]) => d);
}

/** The backing file of a loop device, or null when it is not bound. */
export function backingFile(dev) {
  const f = `/sys/block/${path.basename(dev)}/loop/backing_file`;
  return existsSync(f) ? readFileSync(f, 'utf8').trim() : null;
}

/** A block device's size in bytes, from sysfs. */
export function deviceSize(dev) {
  return Number(readFileSync(`/sys/block/${path.basename(dev)}/size`, 'utf8').trim()) * 512;
}

export function isBlockDevice(dev) {
  return statSync(dev).isBlockDevice();
}

/**
 * Headless Chromium on a fresh profile. Its outbound connections are refused
 * on the test machines, so everything is switched off that would try one.
 */
export async function browser() {
  const profile = mkdtempSync('/tmp/bpdash-chromium');
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: 1280, height: 800 },
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  return {
    context,
    async close() {
      await context.close();
      rmSync(profile, { recursive: true, force: true });
    },
  };
}

/** Saves a screenshot of the page as a test artifact. */
export async function screenshot(page, name) {
  mkdirSync(SCREENSHOTS, { recursive: true });
  await page.screenshot({ path: path.join(SCREENSHOTS, `${name}.png`), fullPage: true });
}

/**
 * Writes to a block device in a loop for `secs` seconds (direct I/O, so the
 * kernel's counters move at once); returns a promise of its exit.
 */
export function writer(dev, secs) {
  const script = `end=$((SECONDS+${secs})); while [ $SECONDS -lt $end ]; do
    dd if=/dev/zero of=${dev} bs=64k count=32 oflag=direct conv=notrunc status=none || exit 1; sleep 0.05; done`;
  const p = spawn('bash', ['-c', script], { stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  p.stderr.on('data', (d) => { err += d; });
  return new Promise((resolve, reject) => {
    p.once('exit', (code) => (code === 0 ? resolve() : reject(new Error(`writer failed (${code}): ${err}`))));
  });
}
