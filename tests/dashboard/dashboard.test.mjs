// The dashboard in a real browser against a real service with real loop
// volumes: what the pages show is what the API says, actions from the forms
// reach the kernel, refusals are shown with the API's message, and the pages
// follow changes live. Run by tests/run-all.sh (root: loop devices).
//
// The tests run in order and share one service and one browser tab: each
// builds on what the previous ones made.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import {
  closeSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync,
} from 'node:fs';
import { after, before, describe, test } from 'node:test';

import {
  REPO, SCREENSHOTS, Service, TOKEN, backingFile, browser, deviceSize, isBlockDevice, screenshot, until, writer,
} from './harness.mjs';

const MiB = 2 ** 20;

let svc;
let br;
let page;
/** Every request the browser made: URL and headers. */
const requests = [];
const pageErrors = [];

before(async () => {
  // This run's screenshots only.
  rmSync(SCREENSHOTS, { recursive: true, force: true });
  svc = await Service.start();
  br = await browser();
  page = await br.context.newPage();
  page.on('request', (r) => requests.push({ url: r.url(), headers: r.headers() }));
  page.on('pageerror', (e) => pageErrors.push(e.message));
});

after(async () => {
  if (br) await br.close();
  if (svc) await svc.stop();
});

/** Opens a dashboard route in the current tab, without reloading it. */
async function go(hash) {
  await page.evaluate((h) => { location.hash = h; }, hash);
  await page.locator('main h1').first().waitFor();
}

function volumeRow(name) {
  return page.locator(`tr[data-volume="${name}"]`);
}

async function apiVolume(name) {
  return (await svc.call('GET', `/v1/volumes/${name}`)).body;
}

/**
 * `obj` as an answer of the API's schema `name`: every field it requires,
 * none it does not know (as openapi.json has them). For the answers a host
 * with NVMe/TCP gives, which this one cannot.
 */
function shaped(name, obj) {
  const s = JSON.parse(readFileSync(`${REPO}/openapi/openapi.json`, 'utf8')).components.schemas[name];
  for (const k of s.required) assert.ok(k in obj, `${name} has ${k}`);
  for (const k of Object.keys(obj)) assert.ok(k in s.properties, `${name} knows ${k}`);
  return obj;
}

/** A route handler answering `body` as the API's JSON. */
const json = (body) => (route) => route.fulfill({ status: 200, contentType: 'application/json', body: JSON.stringify(body) });

describe('dashboard', { concurrency: false }, () => {
  test('the page loads without a token and asks for one; a wrong token is refused with the API message', async () => {
    await page.goto(svc.url);
    const field = page.getByLabel('API token');
    await field.waitFor();
    assert.ok(await field.evaluate((el) => el === document.activeElement), 'the token field has the focus');
    await screenshot(page, 'login');

    await field.fill('not-the-token');
    await page.getByRole('button', { name: 'Sign in' }).click();
    const alert = page.locator('#login [role=alert]');
    await alert.waitFor();
    // The message the API gives for a missing/wrong token.
    const noToken = await fetch(`${svc.url}v1/host`).then((r) => r.json());
    assert.match(await alert.innerText(), new RegExp(noToken.error.message.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')));
    await screenshot(page, 'login-refused');

    await field.fill(TOKEN);
    await field.press('Enter');
    await page.locator('#nav').waitFor();
    await page.locator('#live[data-state=live]').waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem('blockplane.token')), TOKEN);
  });

  test('the host page shows the kernel and every backend and policy, with why not', async () => {
    const host = await svc.ok('GET', '/v1/host');
    await go('#/host');
    await page.locator('[data-field=kernel]').waitFor();
    assert.equal(await page.locator('[data-field=kernel]').innerText(), host.kernel);
    for (const b of ['loop', 'ublk', 'dm']) {
      const row = page.locator(`tr[data-backend=${b}]`);
      const text = await row.innerText();
      assert.match(text, host.backends[b].available ? /available/ : /not available/, b);
      if (host.backends[b].reason) assert.ok(text.includes(host.backends[b].reason), `${b}: ${text}`);
      if (host.backends[b].features) {
        for (const f of host.backends[b].features.names) assert.ok(text.includes(f), `ublk feature ${f}`);
      }
    }
    for (const p of ['nowait', 'threaded', 'direct']) {
      const text = await page.locator(`tr[data-policy=${p}]`).innerText();
      if (host.policies[p].reason) assert.ok(text.includes(host.policies[p].reason), `${p}: ${text}`);
    }
    await screenshot(page, 'host');
  });

  test('the volume list shows what the API returns', async () => {
    await svc.loopVolume('alpha', 64);
    await svc.loopVolume('beta', 32, { read_only: true });
    await go('#/volumes');
    await until('both volumes listed', async () => (await page.locator('tr[data-volume]').count()) === 2);
    const vols = await svc.ok('GET', '/v1/volumes');
    assert.equal(vols.length, 2);
    for (const v of vols) {
      const row = volumeRow(v.name);
      const cell = (f) => row.locator(`[data-field=${f}]`).innerText();
      assert.equal(await cell('backend'), v.backend);
      assert.equal(await cell('device'), v.device);
      assert.match(await cell('state'), new RegExp(`^${v.state}`));
      assert.equal(await cell('read_only'), v.read_only ? 'yes' : 'no');
      assert.equal(await cell('size'), `${(v.size_bytes / MiB).toFixed(1)} MiB`);
      assert.match(await cell('dispatch'), new RegExp(v.dispatch));
      assert.ok((await cell('dispatch')).includes(v.dispatch_reason), 'the policy reason is shown');
      assert.equal(await cell('qos'), 'none');
      // A loop volume has no worker, so no build to show.
      assert.equal(v.worker_version, null);
      assert.equal(await cell('worker'), '–');
    }
    await screenshot(page, 'volumes');
  });

  test('a volume made elsewhere appears without a reload (event stream)', async () => {
    await page.evaluate(() => { window.noReload = true; });
    await svc.loopVolume('gamma', 16);
    await volumeRow('gamma').waitFor({ timeout: 10000 });
    assert.equal(await page.evaluate(() => window.noReload), true, 'the page was not reloaded');
  });

  test('creating an image from the form, with the keyboard, makes the file', async () => {
    await go('#/images');
    const form = page.getByRole('form', { name: 'Add an image' });
    await form.getByLabel('Name').fill('delta-img');
    assert.equal(await form.getByLabel('Path').inputValue(), `${svc.images}/delta-img.img`, 'the path follows the name');
    await form.getByLabel('Size').fill('32M');
    await form.getByLabel('Allocation').selectOption('full');
    await form.getByLabel('Name').press('Enter');
    await form.locator('.ok[role=status]').waitFor();
    assert.match(await form.locator('.ok').innerText(), /Image delta-img added: 32\.0 MiB/);
    const img = await svc.ok('GET', '/v1/images/delta-img');
    assert.equal(img.size_bytes, 32 * MiB);
    assert.equal(img.allocation, 'full');
    assert.ok(existsSync(img.path));
    await page.locator('tr[data-image="delta-img"]').waitFor();
    const row = await page.locator('tr[data-image="alpha-img"]').innerText();
    assert.match(row, /64\.0 MiB/);
    assert.match(row, /alpha/, 'the volumes using an image are listed');
    await screenshot(page, 'images');
  });

  test('creating a volume from the form makes a loop device', async () => {
    await go('#/volumes');
    const form = page.getByRole('form', { name: 'Create a volume' });
    await form.getByLabel('Name').fill('delta');
    await form.getByLabel('Image').selectOption('delta-img');
    await form.getByLabel('Backend').selectOption('loop');
    await form.getByRole('button', { name: 'Create volume' }).click();
    await form.locator('.ok[role=status]').waitFor({ timeout: 20000 });
    const v = await apiVolume('delta');
    assert.equal(v.state, 'attached');
    assert.match(v.device, /^\/dev\/loop\d+$/);
    assert.ok((await form.locator('.ok').innerText()).includes(v.device), 'the new device is named');
    assert.ok(isBlockDevice(v.device), `${v.device} is a block device`);
    const img = await svc.ok('GET', '/v1/images/delta-img');
    assert.equal(backingFile(v.device), img.path, 'the loop device serves the image');
    assert.equal(deviceSize(v.device), 32 * MiB);
    await volumeRow('delta').waitFor();
  });

  test('read-only chosen in the form shows in the API and in the kernel', async () => {
    await svc.image('epsilon-img', 16);
    const form = page.getByRole('form', { name: 'Create a volume' });
    await until('the new image in the form', async () =>
      (await form.getByLabel('Image').locator('option[value="epsilon-img"]').count()) === 1);
    await form.getByLabel('Name').fill('epsilon');
    await form.getByLabel('Image').selectOption('epsilon-img');
    await form.getByLabel('Backend').selectOption('loop');
    await form.getByLabel('Read-only').check();
    await form.getByRole('button', { name: 'Create volume' }).click();
    await form.locator('.ok[role=status]').waitFor({ timeout: 20000 });
    const v = await apiVolume('epsilon');
    assert.equal(v.read_only, true);
    assert.equal(readFileSync(`/sys/block/${v.device.slice(5)}/ro`, 'utf8').trim(), '1', 'the kernel device is read-only');
    await until('the row', async () =>
      (await volumeRow('epsilon').locator('[data-field=read_only]').innerText().catch(() => '')) === 'yes');
  });

  test('API refusals are shown with their message: a duplicate volume and a duplicate image', async () => {
    const form = page.getByRole('form', { name: 'Create a volume' });
    // Images in use are listed but not offered (one image serves one volume).
    const taken = form.locator('option[value="alpha-img"]');
    assert.ok(await taken.isDisabled(), 'an image in use is not offered');
    assert.match(await taken.innerText(), /in use by alpha/);
    await svc.image('spare-img', 8);
    await form.locator('option[value="spare-img"]').waitFor({ state: 'attached' });
    assert.equal(await form.getByLabel('Image').inputValue(), 'spare-img', 'the free image is the default');
    // This host runs loop only: dispatch and QoS are not offered.
    assert.ok(await form.getByLabel('QoS IOPS limit').isDisabled(), 'QoS needs ublk or dm');
    assert.ok(await form.getByLabel('Dispatch policy').isDisabled(), 'a policy needs ublk or dm');
    await form.getByLabel('Name').fill('delta');
    await form.getByLabel('Image').selectOption('spare-img');
    await form.getByLabel('Backend').selectOption('loop');
    await form.getByRole('button', { name: 'Create volume' }).click();
    const alert = form.locator('[role=alert]');
    await alert.waitFor();
    // The same request straight to the API: the page shows its message.
    const direct = await svc.call('POST', '/v1/volumes',
      { name: 'delta', image: 'spare-img', backend: 'loop', dispatch: 'auto', read_only: false });
    assert.equal(direct.status, 409);
    assert.equal(await alert.locator('.message').innerText(), direct.body.error.message);
    assert.match(await alert.innerText(), new RegExp(`${direct.body.error.code}, HTTP 409`));
    assert.equal((await apiVolume('delta')).image_id, (await svc.ok('GET', '/v1/images/delta-img')).id, 'unchanged');
    await screenshot(page, 'error-duplicate-volume');

    await go('#/images');
    const iform = page.getByRole('form', { name: 'Add an image' });
    await iform.getByLabel('Name').fill('delta-img');
    await iform.getByLabel('Path').fill(`${svc.images}/other.img`);
    await iform.getByLabel('Size').fill('8M');
    await iform.getByRole('button', { name: 'Add image' }).click();
    const ialert = iform.locator('[role=alert]');
    await ialert.waitFor();
    const idirect = await svc.call('POST', '/v1/images',
      { name: 'delta-img', path: `${svc.images}/other.img`, create: { size_bytes: 8 * MiB } });
    assert.equal(idirect.status, 409);
    assert.equal(await ialert.locator('.message').innerText(), idirect.body.error.message);
    assert.ok(!existsSync(`${svc.images}/other.img`), 'no file was made');
  });

  test('a loop volume offers no live control it cannot make: each is off and says why', async () => {
    const v = await apiVolume('delta');
    // Hold the page's read of the volume back: its controls must wait for it
    // (a click before the volume is known once threw in the page).
    const volumeUrl = (u) => new URL(u).pathname === `/v1/volumes/${v.id}`;
    let release;
    const held = new Promise((r) => { release = r; });
    await page.route(volumeUrl, async (route) => { await held; await route.continue(); }, { times: 1 });
    const ro = page.getByRole('button', { name: 'Make read-only' });
    try {
      await go(`#/volumes/${v.id}`);
      assert.ok(await ro.isDisabled(), 'disabled until the volume is loaded');
    } finally {
      release();
    }
    await until('the volume is shown', async () =>
      (await page.locator('[data-field=backend]').innerText()) === 'loop');
    assert.ok(await ro.isDisabled(), 'read-only cannot change live on loop');
    assert.ok(await page.getByRole('button', { name: 'Apply policy' }).isDisabled());
    assert.ok(await page.getByRole('button', { name: 'Set limits' }).isDisabled());
    assert.ok(await page.getByRole('button', { name: 'Clear limits' }).isDisabled());
    const disp = page.locator('form[aria-labelledby=dispatch-h] select');
    assert.ok(await disp.isDisabled());
    assert.equal(await disp.inputValue(), 'kernel', 'the menu shows what runs, not "auto"');
    assert.match(await page.locator('section[aria-labelledby=ro-h]').innerText(), /loop driver cannot change this/);
    assert.match(await page.locator('form[aria-labelledby=dispatch-h]').innerText(), /policies apply to ublk and dm/);
    assert.ok(!(await page.getByRole('button', { name: 'Delete volume…' }).isDisabled()), 'delete still works');
    // The API refuses the same change, whatever a page offers.
    const direct = await svc.call('PATCH', `/v1/volumes/${v.id}`, { read_only: true });
    assert.equal(direct.status, 422);
    assert.equal(direct.body.error.code, 'not_live');
    assert.equal((await apiVolume('delta')).updated_at, v.updated_at, 'unchanged');
    await screenshot(page, 'volume-loop-controls');
  });

  test('a change loop makes live: growing the image from the UI grows the device, after a confirmation', async () => {
    const v = await apiVolume('delta');
    await go('#/images');
    // A refusal in another form first: the next action makes it stale.
    const iform = page.getByRole('form', { name: 'Add an image' });
    await iform.getByLabel('Name').fill('delta-img');
    await iform.getByLabel('Path').fill(`${svc.images}/other.img`);
    await iform.getByLabel('Size').fill('8M');
    await iform.getByRole('button', { name: 'Add image' }).click();
    await iform.locator('[role=alert]').waitFor();
    const form = page.getByRole('form', { name: 'Grow an image' });
    await form.getByLabel('Image').selectOption({ label: 'delta-img (32.0 MiB)' });
    await form.getByLabel('New size').fill('48M');
    await form.getByRole('button', { name: 'Grow image' }).click();
    const dialog = page.getByRole('dialog');
    await dialog.waitFor();
    assert.match(await dialog.innerText(), /From 32\.0 MiB to 48\.0 MiB/);
    await dialog.getByRole('button', { name: 'Cancel' }).click();
    await dialog.waitFor({ state: 'hidden' });
    assert.equal((await svc.ok('GET', '/v1/images/delta-img')).size_bytes, 32 * MiB, 'cancel changes nothing');

    await form.getByRole('button', { name: 'Grow image' }).click();
    await dialog.getByRole('button', { name: 'Grow image' }).click();
    await form.locator('.ok[role=status]').waitFor();
    assert.match(await form.locator('.ok').innerText(), /delta-img is now 48\.0 MiB/);
    assert.equal(await iform.locator('[role=alert]').count(), 0, 'the earlier refusal is no longer shown');
    assert.equal((await svc.ok('GET', '/v1/images/delta-img')).size_bytes, 48 * MiB);
    assert.equal((await apiVolume('delta')).size_bytes, 48 * MiB, 'the volume followed');
    assert.equal(deviceSize(v.device), 48 * MiB, 'the kernel device grew');
    await until('the table to show the new size', async () =>
      /48\.0 MiB/.test(await page.locator('tr[data-image="delta-img"]').innerText()));
  });

  test('the volume page follows changes made elsewhere: size and event history', async () => {
    const v = await apiVolume('delta');
    await go(`#/volumes/${v.id}`);
    await until('the size', async () => (await page.locator('[data-field=size]').innerText()).startsWith('48.0 MiB'));
    await page.locator('#live[data-state=live]').waitFor();
    await svc.ok('POST', '/v1/images/delta-img/resize', { size_bytes: 64 * MiB });
    await until('the new size on the page', async () =>
      (await page.locator('[data-field=size]').innerText()).startsWith('64.0 MiB'));
    const last = (await svc.ok('GET', '/v1/events?volume=delta&limit=1')).at(-1);
    await page.locator(`.events li[data-event-id="${last.id}"]`).waitFor();
    assert.ok((await page.locator(`.events li[data-event-id="${last.id}"]`).innerText()).includes(last.message));
  });

  test('the charts gain data points while a writer runs', async () => {
    const v = await apiVolume('delta');
    const iops = page.locator('[data-chart=iops]');
    await until('two samples', async () => Number(await iops.getAttribute('data-points')) >= 2);
    // Let the sampler settle so that the writer's samples are new ones.
    const writes = () => iops.locator('li[data-series=write]').getAttribute('data-nonzero').then(Number);
    const points0 = Number(await iops.getAttribute('data-points'));
    const writes0 = await writes();
    const done = writer(v.device, 7);
    await until('write IOPS samples', async () => (await writes()) >= writes0 + 3, 15000);
    const points1 = Number(await iops.getAttribute('data-points'));
    assert.ok(points1 >= points0 + 3, `points grew: ${points0} -> ${points1}`);
    const bw = page.locator('[data-chart=bandwidth] li[data-series=write]');
    assert.ok(Number(await bw.getAttribute('data-nonzero')) >= 1, 'bandwidth saw the writes');
    assert.ok(await iops.locator('polyline[data-series=write]').count() >= 1, 'the write line is drawn');
    const stats = await svc.ok('GET', `/v1/volumes/${v.id}/stats`);
    assert.ok(stats.write.ops > 0);
    assert.match(await page.locator('tr[data-op=write]').innerText(), /IOPS/);
    await screenshot(page, 'volume');
    await done;
  });

  test('charts open full from the service history, with clock times and labels that fit', async () => {
    const v = await apiVolume('delta');
    const hist = await svc.ok('GET', `/v1/volumes/${v.id}/stats/history?seconds=300`);
    const written = hist.points.filter((p) => p.write.iops > 0).length;
    assert.ok(written >= 3, `the service kept the writer's seconds: ${written} of ${hist.points.length}`);
    // A new page load forgets earlier visits: what the charts show now comes from the service.
    await page.reload();
    await go(`#/volumes/${v.id}`);
    const iops = page.locator('[data-chart=iops]');
    await until('the chart filled at once', async () =>
      Number(await iops.getAttribute('data-points')) >= hist.points.length, 5000);
    const nonzero = (chart, series) =>
      page.locator(`[data-chart=${chart}] li[data-series=${series}]`).getAttribute('data-nonzero').then(Number);
    assert.ok((await nonzero('iops', 'write')) >= written, 'the writer shows from before the page opened');
    assert.ok((await nonzero('latency-mean', 'write')) >= 1, 'a loop volume has a mean latency (kernel time in queue)');
    const times = await iops.locator('text.time').allTextContents();
    assert.equal(times.length, 3, `start, middle and end: ${times}`);
    for (const t of times) assert.match(t, /^\d\d:\d\d:\d\d$/, `the time axis shows clock times: ${times}`);
    for (const chart of ['iops', 'bandwidth', 'latency-mean']) {
      const left = await page.locator(`[data-chart=${chart}] g.grid text`)
        .evaluateAll((ts) => Math.min(...ts.map((t) => t.getBBox().x)));
      assert.ok(left >= 0, `${chart}: every y label fits (leftmost x ${left})`);
    }
    // The widest label a bandwidth chart draws at 100 MiB/s once lost its first digit.
    const [left, labels] = await page.evaluate(async () => {
      const { LineChart, niceCeilBinary } = await import('/dashboard/chart.js');
      const { bandwidth } = await import('/dashboard/format.js');
      const c = new LineChart({
        id: 'probe', title: 'probe', series: [{ key: 'w', label: 'w', color: '#000' }],
        format: bandwidth, nice: niceCeilBinary,
      });
      document.body.append(c.el);
      c.push(Date.now(), { w: 100 * 2 ** 20 });
      const ts = [...c.el.querySelectorAll('g.grid text')];
      const out = [Math.min(...ts.map((t) => t.getBBox().x)), ts.map((t) => t.textContent)];
      c.dispose();
      c.el.remove();
      return out;
    });
    assert.ok(left >= 0, `labels ${labels} fit: leftmost x ${left}`);
    await screenshot(page, 'volume-history');
  });

  test('volumes show their image by name (and path), and the volumes table their IOPS and latency', async () => {
    const v = await apiVolume('delta');
    const img = (await svc.ok('GET', '/v1/images')).find((i) => i.id === v.image_id);
    await go(`#/volumes/${v.id}`);
    const fact = page.locator('[data-field=image]');
    await until('the image fact', async () => (await fact.innerText()).includes(img.name));
    assert.ok((await fact.innerText()).includes(img.path), await fact.innerText());
    assert.ok(!(await page.locator('main').innerText()).includes(v.image_id), 'no image id on the page');

    const writes = writer(v.device, 5);
    await go('#/volumes');
    const cell = (f) => volumeRow('delta').locator(`[data-field=${f}]`).innerText();
    assert.equal(await cell('image'), img.name);
    await until('delta\'s IOPS', async () => Number((await cell('iops')).replace(/,/g, '')) > 0, 10000);
    assert.match(await cell('latency'), /\d/, 'a mean latency while it writes');
    assert.equal(await volumeRow('alpha').locator('[data-field=iops]').innerText(), '0', 'an idle volume: 0 IOPS');
    await screenshot(page, 'volumes-busy');
    await writes;
  });

  test('the overview shows health, build, older workers, capacity per image root, volumes by state and the busiest volumes', async () => {
    const [host, volumes] = [await svc.ok('GET', '/v1/host'), await svc.ok('GET', '/v1/volumes')];
    await go('#/overview');
    await until('healthy', async () => (await page.locator('[data-field=health]').innerText()) === 'healthy');
    const root = host.image_root_capacity[0];
    const row = page.locator(`tr[data-root="${root.path}"]`);
    await row.waitFor();
    const text = await row.innerText();
    assert.match(text, new RegExp(`${root.images}$`), `images under the root: ${text}`);
    assert.ok(text.includes('×'), `provisioned against the filesystem's size: ${text}`);
    assert.equal(await page.locator('[data-field=build]').innerText(), host.build.version);
    assert.match(await page.locator('[data-field=older-workers]').innerText(), /^none/);
    for (const st of ['attached', 'error']) {
      const n = volumes.filter((v) => v.state === st).length;
      assert.equal((await page.locator(`tr[data-state=${st}] td`).innerText()).trim(), String(n), st);
    }
    // delta was written to a few seconds ago (the charts tests): it is listed with its figures.
    await page.locator('tr[data-volume=delta]').first().waitFor();
    assert.ok(await page.getByRole('link', { name: 'Overview' }).getAttribute('aria-current'), 'the nav marks the page');
    await screenshot(page, 'overview');
  });

  test('a volume page says the volume is not exported and why this service cannot export; the volumes page lists no remote volumes', async () => {
    const v = await apiVolume('delta');
    const host = await svc.ok('GET', '/v1/host');
    const refused = await svc.call('GET', `/v1/volumes/${v.id}/export`);
    assert.equal(refused.status, 404);
    assert.equal(refused.body.error.code, 'export_not_found');
    await go(`#/volumes/${v.id}`);
    const state = page.locator('[data-section=export] [data-field=export-state]');
    await until('the export section', async () => /^Not exported\./.test(await state.innerText()));
    // This service has no --export-address: the page says so, in the host's words.
    assert.equal(host.fabric.target.available, false);
    assert.ok((await state.innerText()).includes(host.fabric.target.reason), await state.innerText());
    assert.equal(await page.locator('[data-section=export] [role=alert]').count(), 0, 'no export is no error');

    assert.deepEqual(await svc.ok('GET', '/v1/remotes'), []);
    await go('#/volumes');
    await page.locator('[data-section=remotes] [data-field=no-remotes]').waitFor();
    assert.equal(await page.locator('tr[data-remote]').count(), 0);
  });

  test('an export and remote volumes as a host with NVMe/TCP answers them: connected, not connected, or unknown', async () => {
    // This host has no NVMe target or initiator: the page gets the answers
    // a host with them gives (their fields as openapi.json has them).
    const v = await apiVolume('delta');
    const hostNqn = (n) => `nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000000${n}`;
    const exp = shaped('Export', {
      volume_id: v.id,
      volume_name: v.name,
      nqn: `nqn.2026-12.dev.blockplane:test:${v.name}`,
      addresses: ['192.0.2.10:4420'],
      read_only: false,
      auth: 'dhchap',
      hosts: [1, 2, 3].map((n) => shaped('ExportHost', { host_nqn: hostNqn(n), connected: [true, false, null][n - 1] })),
      state: 'serving',
      state_reason: null,
      created_at: v.created_at,
    });
    const remote = shaped('Remote', {
      id: '6f1c3a52-0d7e-4c39-9a51-2b8d5f0e7c11',
      name: 'far-disk',
      address: '192.0.2.20:4420',
      nqn: 'nqn.2026-12.dev.blockplane:other:disk',
      state: 'reconnecting',
      state_reason: 'the connection to 192.0.2.20:4420 is connecting: I/O waits until it is back',
      device: '/dev/mapper/blockplane-remote-6f1c3a52-0d7e-4c39-9a51-2b8d5f0e7c11',
      nvme_device: '/dev/nvme1n1',
      size_bytes: 64 * MiB,
      read_only: true,
      move_id: null,
      volume: null,
      created_at: v.created_at,
    });
    const exportUrl = (u) => new URL(u).pathname === `/v1/volumes/${v.id}/export`;
    const remotesUrl = (u) => new URL(u).pathname === '/v1/remotes';
    await page.route(exportUrl, json(exp));
    await page.route(remotesUrl, json([remote]));
    try {
      await go(`#/volumes/${v.id}`);
      const section = page.locator('[data-section=export]');
      await section.locator(`tr[data-host="${hostNqn(1)}"]`).waitFor();
      assert.equal(await section.locator('[data-field=nqn]').innerText(), exp.nqn);
      assert.equal(await section.locator('[data-field=addresses]').innerText(), '192.0.2.10:4420');
      assert.match(await section.locator('[data-field=export-state]').innerText(), /^serving/);
      const connected = (n) => section.locator(`tr[data-host="${hostNqn(n)}"] [data-field=connected]`).innerText();
      assert.equal(await connected(1), 'connected');
      assert.equal(await connected(2), 'not connected');
      assert.match(await connected(3), /^unknown\s+the kernel cannot say/);
      await screenshot(page, 'volume-export');

      await go('#/volumes');
      const row = page.locator('tr[data-remote="far-disk"]');
      await row.waitFor();
      const cell = (f) => row.locator(`[data-field=${f}]`).innerText();
      assert.equal(await cell('address'), remote.address);
      assert.equal(await cell('nqn'), remote.nqn);
      assert.match(await cell('state'), /^reconnecting: the connection/);
      assert.match(await cell('device'), new RegExp(`^${remote.device}\\s+over /dev/nvme1n1`));
      assert.equal(await cell('size'), '64.0 MiB');
      assert.equal(await cell('read_only'), 'yes');
      await screenshot(page, 'volumes-remote');
    } finally {
      await page.unroute(exportUrl);
      await page.unroute(remotesUrl);
    }
  });

  test('a remote volume being moved here shows its progress live, changes its rate limit and cancels after asking; a moved one serves its local volume', async () => {
    // As the previous test: the answers of a host with NVMe/TCP.
    const delta = await apiVolume('delta');
    const at = delta.created_at;
    const id = (n) => `0b7e4c1a-5d2f-4e8b-9c3a-7f1d2e3c4b5${n}`;
    const remote = (n, name, more) => shaped('Remote', {
      id: id(n),
      name,
      address: '192.0.2.20:4420',
      nqn: `nqn.2026-12.dev.blockplane:other:${name}`,
      state: 'attached',
      state_reason: null,
      device: `/dev/mapper/blockplane-remote-${id(n)}`,
      nvme_device: '/dev/nvme1n1',
      size_bytes: 64 * MiB,
      read_only: false,
      move_id: null,
      volume: null,
      created_at: at,
      ...more,
    });
    const move = (n, r, more) => shaped('Move', {
      id: id(n),
      remote: r.id,
      remote_name: r.name,
      image: `${r.name}-here`,
      volume: null,
      source_api: 'http://192.0.2.20:8080',
      source_volume: r.name,
      keep_source_image: false,
      state: 'syncing',
      state_reason: null,
      synced_bytes: 16 * MiB,
      total_bytes: 64 * MiB,
      rate_bytes_per_sec: 8 * MiB,
      rate_limit_bytes_per_sec: 0,
      created_at: at,
      finished_at: null,
      ...more,
    });
    const moving = remote(1, 'near-disk', { move_id: id(3) });
    const moved = remote(2, 'old-disk', {
      state: 'moved', nvme_device: null, move_id: id(4), volume: delta.id,
    });
    let mv = move(3, moving);
    const done = move(4, moved, {
      state: 'done', synced_bytes: 64 * MiB, rate_bytes_per_sec: 0, volume: delta.id, finished_at: at,
    });
    const patches = [];
    const cancels = [];
    const path = (p) => (u) => new URL(u).pathname === p;
    const routes = [
      [path('/v1/remotes'), json([moving, moved])],
      [path('/v1/moves'), (route) => json([mv, done])(route)],
      [path(`/v1/moves/${mv.id}`), (route) => {
        const body = route.request().postDataJSON();
        patches.push({ method: route.request().method(), body });
        mv = { ...mv, rate_limit_bytes_per_sec: body.rate_limit_bytes_per_sec };
        return json(mv)(route);
      }],
      [path(`/v1/moves/${mv.id}/cancel`), (route) => {
        cancels.push(route.request().method());
        mv = {
          ...mv,
          state: 'cancelled',
          state_reason: 'cancelled: the node serves the remote device again, which holds every write',
          rate_bytes_per_sec: 0,
          finished_at: at,
        };
        return json(mv)(route);
      }],
    ];
    for (const [url, handler] of routes) await page.route(url, handler);
    try {
      // The volumes page is open from the previous test: leave it to load it anew.
      await go('#/host');
      await go('#/volumes');
      const row = page.locator('tr[data-remote="near-disk"]');
      await row.waitFor();
      const cell = (f) => row.locator(`[data-field=${f}]`).innerText();
      assert.match(await cell('move-state'), /^syncing/);
      assert.equal(await cell('move-progress'), '25% (16.0 MiB of 64.0 MiB) into image near-disk-here');
      assert.equal(await cell('move-rate'), '8.00 MiB/s');
      assert.equal(await cell('move-limit'), 'none');
      assert.equal(await row.locator('progress').getAttribute('value'), '25');

      // A move's progress makes no event: the page reads it every second,
      // in place, and a limit being typed stays.
      const limit = row.getByLabel('New rate limit of the move of near-disk (bytes/s; 0: none)');
      await limit.fill('fast');
      mv = { ...mv, synced_bytes: 32 * MiB, rate_bytes_per_sec: 12 * MiB };
      await until('the new progress', async () => (await cell('move-progress')).startsWith('50% (32.0 MiB of 64.0 MiB)'));
      assert.equal(await cell('move-rate'), '12.0 MiB/s');
      assert.equal(await limit.inputValue(), 'fast', 'the typed limit stays');

      // A limit the page cannot read is refused before any request.
      const out = page.locator('[data-section=remotes] .outcome');
      await row.getByRole('button', { name: 'Set limit' }).click();
      await out.locator('[role=alert]').waitFor();
      assert.match(await out.innerText(), /rate limit: 'fast' is not a size/);
      assert.deepEqual(patches, []);
      await limit.fill('50M');
      await limit.press('Enter');
      await out.locator('.ok[role=status]').waitFor();
      assert.match(await out.innerText(), /The move of near-disk now copies at most 50\.0 MiB\/s/);
      assert.deepEqual(patches, [{ method: 'PATCH', body: { rate_limit_bytes_per_sec: 50 * MiB } }]);
      await until('the new limit', async () => (await cell('move-limit')) === '50.0 MiB/s');

      // The moved one: its device serves the local volume, its move is done.
      const old = page.locator('tr[data-remote="old-disk"]');
      assert.match(await old.locator('[data-field=state]').innerText(), /^moved/);
      assert.equal(await old.locator('[data-field=local-volume]').innerText(), 'serves local volume delta');
      assert.equal(await old.locator('[data-field=local-volume] a').getAttribute('href'), `#/volumes/${delta.id}`);
      assert.match(await old.locator('[data-field=move-state]').innerText(), /^done/);
      assert.match(await old.locator('[data-field=move-progress]').innerText(), /^100% \(64\.0 MiB of 64\.0 MiB\)/);
      assert.equal(await old.locator('button').count(), 0, 'an ended move has no controls');
      await screenshot(page, 'volumes-remote-move');

      // Cancel asks first; Escape leaves the move running.
      const cancel = row.getByRole('button', { name: 'Cancel the move of near-disk' });
      await cancel.click();
      const dialog = page.getByRole('dialog');
      await dialog.waitFor();
      assert.match(await dialog.innerText(), /Cancel the move of near-disk\?/);
      await page.keyboard.press('Escape');
      await dialog.waitFor({ state: 'hidden' });
      assert.deepEqual(cancels, [], 'Escape cancels nothing');
      await cancel.click();
      await dialog.getByRole('button', { name: 'Cancel move' }).click();
      // The set limit's success is still shown until the cancel's answer
      // replaces it: wait for that answer, not for any success.
      await until('the cancel answered', async () => /^Move of near-disk: cancelled: the node serves the remote device again/.test(await out.innerText()));
      assert.deepEqual(cancels, ['POST']);
      await until('the cancelled move', async () => /^cancelled/.test(await cell('move-state')));
      assert.equal(await row.locator('button').count(), 0, 'a cancelled move has no controls');
      assert.equal(await row.locator('[data-field=move-rate]').count(), 0, 'nor a rate');
    } finally {
      for (const [url] of routes) await page.unroute(url);
    }
  });

  test('number columns: each header lines up with its numbers (right edges), in tabular figures', async () => {
    const delta = await apiVolume('delta');
    for (const hash of ['#/overview', '#/images', '#/volumes', `#/volumes/${delta.id}`]) {
      await go(hash);
      if (hash.includes(delta.id)) await page.locator('tr[data-op=write] td.num').first().waitFor();
      else await page.waitForTimeout(500);
      const { checked, bad } = await page.evaluate(() => {
        // The right edge of the text an element shows (not of its box).
        const textRight = (el) => {
          let right = -Infinity;
          const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
          for (let n = walk.nextNode(); n; n = walk.nextNode()) {
            if (!n.textContent.trim()) continue;
            const r = document.createRange();
            r.selectNodeContents(n);
            for (const rect of r.getClientRects()) right = Math.max(right, rect.right);
          }
          return right;
        };
        const out = { checked: 0, bad: [] };
        for (const t of document.querySelectorAll('main table')) {
          const heads = [...t.querySelectorAll('thead th')];
          heads.forEach((th, i) => {
            const cells = [...t.querySelectorAll('tbody tr')].map((tr) => tr.children[i])
              .filter((c) => c?.classList.contains('num') && c.textContent.trim());
            for (const c of cells) {
              out.checked += 1;
              const [hr, cr] = [textRight(th), textRight(c)];
              const where = `${t.querySelector('caption')?.textContent.slice(0, 30)} / ${th.textContent}`;
              if (Math.abs(hr - cr) > 1) out.bad.push(`${where}: header ends at ${hr.toFixed(1)}, "${c.textContent}" at ${cr.toFixed(1)}`);
              for (const el of [th, c]) {
                if (!getComputedStyle(el).fontVariantNumeric.includes('tabular-nums')) out.bad.push(`${where}: ${el.tagName} not in tabular figures`);
              }
            }
          });
        }
        return out;
      });
      assert.ok(checked > 0, `${hash}: some number cells were checked`);
      assert.deepEqual(bad, [], `${hash}: number columns`);
    }
  });

  test('deleting asks first: Escape cancels, confirming removes the device', async () => {
    const v = await apiVolume('gamma');
    await go('#/volumes');
    const del = volumeRow('gamma').getByRole('button', { name: 'Delete volume gamma' });
    await del.click();
    const dialog = page.getByRole('dialog');
    await dialog.waitFor();
    assert.match(await dialog.innerText(), /Delete volume gamma\?/);
    assert.ok(await dialog.getByRole('button', { name: 'Cancel' }).evaluate((b) => b === document.activeElement),
      'Cancel has the focus');
    await screenshot(page, 'confirm-delete');
    await page.keyboard.press('Escape');
    await dialog.waitFor({ state: 'hidden' });
    assert.equal((await svc.call('GET', '/v1/volumes/gamma')).status, 200, 'still there');
    assert.equal(backingFile(v.device) !== null, true);

    await del.click();
    await dialog.getByRole('button', { name: 'Delete volume' }).click();
    await volumeRow('gamma').waitFor({ state: 'detached' });
    assert.equal((await svc.call('GET', '/v1/volumes/gamma')).status, 404);
    assert.equal(backingFile(v.device), null, 'the loop device is released');
  });

  test('deleting a volume in use says by whom and at what rate, and wants its name typed', async () => {
    const v = await svc.loopVolume('busy', 16);
    const fd = openSync(v.device, 'r');
    const holder = spawn('sleep', ['60'], { stdio: [fd, 'ignore', 'ignore'] });
    closeSync(fd);
    const dialog = page.getByRole('dialog');
    const ok = dialog.getByRole('button', { name: 'Delete volume' });
    const field = dialog.getByLabel('Type busy to confirm');
    try {
      await go('#/volumes');
      await volumeRow('busy').getByRole('button', { name: 'Delete volume busy' }).click();
      await dialog.waitFor();
      const text = await dialog.innerText();
      assert.match(text, /Volume busy is in use/);
      assert.ok(text.includes(`open by sleep (pid ${holder.pid})`), `who holds it open: ${text}`);
      assert.ok(await ok.isDisabled(), 'no delete before the name is typed');
      assert.ok(await field.evaluate((el) => el === document.activeElement), 'the name field has the focus');
      await field.fill('bus');
      assert.ok(await ok.isDisabled(), 'a wrong name does not allow the delete');
      await field.press('Enter');
      assert.ok(await dialog.isVisible(), 'Enter with a wrong name does nothing');
      await screenshot(page, 'confirm-delete-busy');
      await page.keyboard.press('Escape');
      await dialog.waitFor({ state: 'hidden' });
      assert.equal((await svc.call('GET', '/v1/volumes/busy')).status, 200, 'still there');
    } finally {
      holder.kill();
      await once(holder, 'exit');
      if (await dialog.isVisible()) await page.keyboard.press('Escape');
    }

    // Closed, but written to in the last seconds: the rate says it is in use (the volume's own page).
    const writes = writer(v.device, 3);
    await until('the writes in the service history', async () =>
      (await svc.ok('GET', '/v1/volumes/busy/usage')).iops > 0, 8000);
    await go(`#/volumes/${v.id}`);
    await page.getByRole('button', { name: 'Delete volume…' }).click();
    await dialog.waitFor();
    const text = await dialog.innerText();
    assert.match(text, /IOPS, .* over the last \d s/, `the I/O rate: ${text}`);
    await writes;
    await field.fill('busy');
    assert.ok(await ok.isEnabled(), 'the name typed allows the delete');
    await field.press('Enter');
    await until('the volume gone', async () => (await svc.call('GET', '/v1/volumes/busy')).status === 404);
    assert.equal(backingFile(v.device), null, 'the loop device is released');
  });

  test('controls have labels, work from the keyboard, and text has enough contrast', async () => {
    for (const hash of ['#/host', '#/images', '#/volumes', `#/volumes/${(await apiVolume('delta')).id}`]) {
      await go(hash);
      await page.waitForTimeout(300);
      const unlabelled = await page.evaluate(() => [...document.querySelectorAll('input, select, textarea')]
        .filter((el) => !el.closest('[hidden]') && el.labels.length === 0 && !el.getAttribute('aria-label'))
        .map((el) => el.outerHTML));
      assert.deepEqual(unlabelled, [], `${hash}: every control has a label`);
      const unnamed = await page.evaluate(() => [...document.querySelectorAll('button, a[href]')]
        .filter((el) => !el.closest('[hidden], dialog') && !(el.getAttribute('aria-label') || el.textContent.trim()))
        .map((el) => el.outerHTML));
      assert.deepEqual(unnamed, [], `${hash}: every button and link has a name`);
      // WCAG AA: 4.5:1 for text against the background it sits on.
      const low = await page.evaluate(() => {
        const rgb = (s) => s.match(/[\d.]+/g).slice(0, 4).map(Number);
        const lum = ([r, g, b]) => {
          const c = [r, g, b].map((v) => {
            const x = v / 255;
            return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4;
          });
          return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
        };
        const bg = (el) => {
          for (let e = el; e; e = e.parentElement) {
            const c = rgb(getComputedStyle(e).backgroundColor);
            if (c.length < 4 || c[3] > 0) return c;
          }
          return [255, 255, 255];
        };
        const bad = [];
        for (const el of document.querySelectorAll('body *')) {
          if (el.closest('[hidden], dialog, svg') || !el.offsetParent) continue;
          const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
          if (!own) continue;
          const s = getComputedStyle(el);
          if (s.opacity !== '1' || el.matches(':disabled')) continue;
          const [a, b] = [lum(rgb(s.color)), lum(bg(el))];
          const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
          if (ratio < 4.5) bad.push(`${el.tagName}.${el.className} "${el.textContent.trim().slice(0, 30)}" ${ratio.toFixed(2)}`);
        }
        return bad;
      });
      assert.deepEqual(low, [], `${hash}: contrast`);
    }
    // Keyboard: a nav link by Tab order and Enter.
    await go('#/volumes');
    await page.locator('#nav a[data-nav=images]').focus();
    await page.keyboard.press('Enter');
    await until('the images page', async () => (await page.locator('main h1').innerText()) === 'Images');
    assert.equal(await page.evaluate(() => document.activeElement.tagName), 'H1', 'focus moves to the new page');
    await page.keyboard.press('Shift+Tab');
    assert.ok(await page.evaluate(() => document.activeElement !== document.body), 'focus stays in the page');
  });

  test('usable on a narrow window', async () => {
    await page.setViewportSize({ width: 390, height: 844 });
    try {
      // Every page at a phone's size: each screenshot shows one.
      for (const [hash, name] of [['#/overview', 'overview-narrow'], ['#/host', 'host-narrow'],
        ['#/images', 'images-narrow'], ['#/volumes', 'volumes-narrow'],
        [`#/volumes/${(await apiVolume('delta')).id}`, 'volume-narrow']]) {
        await go(hash);
        await page.waitForTimeout(1200);
        const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
        assert.ok(overflow <= 0, `${hash}: the page does not scroll sideways (${overflow}px)`);
        await screenshot(page, name);
      }
    } finally {
      await page.setViewportSize({ width: 1280, height: 800 });
    }
  });

  test('on TCP with the token, directly: a new tab asks for the token and then works', async () => {
    const tab = await br.context.newPage();
    tab.on('request', (r) => requests.push({ url: r.url(), headers: r.headers() }));
    try {
      await tab.goto(`${svc.tcpUrl}#/volumes`);
      await tab.getByLabel('API token').fill(TOKEN);
      await tab.getByRole('button', { name: 'Sign in' }).click();
      await tab.locator('tr[data-volume="delta"]').waitFor();
      await tab.locator('#live[data-state=live]').waitFor();
      const count = await tab.locator('tr[data-volume]').count();
      assert.equal(count, (await svc.ok('GET', '/v1/volumes')).length);
    } finally {
      await tab.close();
    }
  });

  test('a service without a token: the forward opens the pages with no sign-in', async () => {
    const open = await Service.start({ token: null });
    const tab = await br.context.newPage();
    tab.on('pageerror', (e) => pageErrors.push(e.message));
    try {
      await open.loopVolume('plain', 8);
      await tab.goto(`${open.url}#/volumes`);
      await tab.locator('tr[data-volume="plain"]').waitFor();
      await tab.locator('#live[data-state=live]').waitFor();
      assert.equal(await tab.locator('#login').isHidden(), true, 'no sign-in');
      assert.equal(await tab.getByRole('button', { name: 'Sign out' }).isHidden(), true);
      assert.equal(await tab.locator('tr[data-volume="plain"] [data-field=device]').innerText(),
        (await open.ok('GET', '/v1/volumes/plain')).device);
    } finally {
      await tab.close();
      await open.stop();
    }
  });

  test('a volume page whose service stops says its state is unknown and fades its charts', async () => {
    const gone = await Service.start({ token: null });
    const tab = await br.context.newPage();
    tab.on('pageerror', (e) => pageErrors.push(e.message));
    try {
      const v = await gone.loopVolume('going', 8);
      await tab.goto(`${gone.url}#/volumes/${v.id}`);
      const state = tab.locator('[data-field=state]');
      await until('attached', async () => (await state.innerText()).startsWith('attached'));
      await tab.locator('[data-chart=iops][data-points]').waitFor();
      // The service goes; the forward stays and answers 502 api_unreachable.
      gone.proc.kill('SIGTERM');
      await new Promise((r) => gone.proc.once('exit', r));
      await until('the state is no longer claimed', async () =>
        (await state.innerText()).startsWith('unknown: the service cannot be reached'), 10000);
      assert.equal(await tab.locator('[data-field=state] .state-attached').count(), 0, 'no green attached');
      assert.ok(await tab.locator('section:has(> h2#charts-h)').evaluate((el) => el.classList.contains('stale')),
        'the charts are marked stale');
      await screenshot(tab, 'volume-service-unreachable');
    } finally {
      await tab.close();
      await gone.stop();
    }
  });

  test('signing out forgets the token; the token never went into a URL', async () => {
    await go('#/volumes');
    await page.getByRole('button', { name: 'Sign out' }).click();
    await page.getByLabel('API token').waitFor();
    assert.equal(await page.evaluate(() => sessionStorage.getItem('blockplane.token')), null);
    await page.setViewportSize({ width: 390, height: 844 });
    await screenshot(page, 'login-narrow');
    await page.setViewportSize({ width: 1280, height: 800 });
    assert.ok(requests.length > 10);
    for (const r of requests) assert.ok(!r.url.includes(TOKEN), `token in a URL: ${r.url}`);
    const apiCalls = requests.filter((r) => new URL(r.url).pathname.startsWith('/v1/'));
    assert.ok(apiCalls.length > 0);
    const stream = apiCalls.filter((r) => new URL(r.url).pathname === '/v1/events/stream');
    assert.ok(stream.length > 0, 'the event stream was used');
    for (const r of stream) assert.equal(r.headers.authorization, `Bearer ${TOKEN}`, 'the stream sends the token in its header');
    assert.deepEqual(pageErrors, [], 'no script errors');
  });
});

// Snapshots and clones, on a service of their own: its image root is on this
// host's filesystem (ext4: no shared extents), so every snapshot and clone is
// a background copy, each 16 MiB of it slowed by 100 ms (the `slow_copy` test
// fault) so that its progress can be watched and cancelled.
describe('snapshots and clones', { concurrency: false }, () => {
  let snap;
  let tab;
  const snapName = /^gold-snap-\d{8}-\d{6}$/;
  const imageRow = (name) => tab.locator(`tr[data-image="${name}"]`);
  const readyImage = (name) => until(`${name} ready`, async () =>
    (await snap.ok('GET', `/v1/images/${name}`)).state === 'ready', 30000);
  async function open(hash) {
    await tab.evaluate((h) => { location.hash = h; }, hash);
    await tab.locator('main h1').first().waitFor();
  }

  before(async () => {
    snap = await Service.start({ token: null, env: { BLOCKPLANE_TEST_FAULT: 'slow_copy' } });
    tab = await br.context.newPage();
    tab.on('pageerror', (e) => pageErrors.push(e.message));
    await snap.imageWithData('gold', 64, 8);
    await tab.goto(`${snap.url}#/images`);
    await tab.locator('#live[data-state=live]').waitFor();
  });

  after(async () => {
    if (tab) await tab.close();
    if (snap) await snap.stop();
  });

  test('an image row takes a snapshot with a default name; the list shows it read-only, as a snapshot of its image', async () => {
    await imageRow('gold').getByRole('button', { name: 'Snapshot image gold' }).click();
    const form = tab.getByRole('form', { name: 'Take a snapshot' });
    const name = form.getByLabel('Snapshot name');
    assert.ok(await name.evaluate((el) => el === document.activeElement), 'the name field has the focus');
    const chosen = await name.inputValue();
    assert.match(chosen, snapName, 'the default name: image, -snap-, the time');
    await name.press('Enter');
    await form.locator('.ok[role=status]').waitFor();
    assert.match(await form.locator('.ok').innerText(), new RegExp(`Snapshot ${chosen} is being copied`));
    await readyImage(chosen);
    const listed = await snap.ok('GET', '/v1/images?snapshot_of=gold');
    assert.deepEqual(listed.map((i) => i.name), [chosen]);
    await until('the snapshot ready in the list', async () =>
      /^ready/.test(await imageRow(chosen).locator('[data-field=state]').innerText()));
    const origin = await imageRow(chosen).locator('[data-field=origin]').innerText();
    assert.match(origin, /snapshot of gold/);
    assert.match(origin, /read-only/);
    assert.match(await imageRow('gold').locator('[data-field=snapshots]').innerText(), new RegExp(`snapshots: ${chosen}`));
    // A snapshot is not offered to grow (it cannot).
    const growable = await tab.getByRole('form', { name: 'Grow an image' }).getByLabel('Image')
      .locator('option').allInnerTexts();
    assert.ok(!growable.some((t) => t.startsWith(chosen)), `grow offers ${growable}`);
    await screenshot(tab, 'image-snapshots');
    await tab.setViewportSize({ width: 390, height: 844 });
    try {
      const overflow = await tab.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
      assert.ok(overflow <= 0, `the images page does not scroll sideways (${overflow}px)`);
      await screenshot(tab, 'image-snapshots-narrow');
    } finally {
      await tab.setViewportSize({ width: 1280, height: 800 });
    }
  });

  test('a volume page snapshots its image; the refusal shows on its Snapshot card with the API message', async () => {
    const v = await snap.ok('POST', '/v1/volumes', { name: 'goldv', image: 'gold', backend: 'loop' });
    await open(`#/volumes/${v.id}`);
    const form = tab.getByRole('form', { name: 'Snapshot' });
    const name = form.getByLabel('Snapshot name');
    await until('a default name', async () => snapName.test(await name.inputValue()));
    await name.fill('gold-live');
    await form.getByRole('button', { name: 'Snapshot image' }).click();
    const alert = form.locator('[role=alert]');
    await alert.waitFor();
    const text = await alert.innerText();
    // A copy under a writable volume would not be one moment's state: refused.
    assert.match(text, /volume_attached_snapshot_unsupported, HTTP 409/);
    assert.ok(text.includes("'goldv'"), `names the volume: ${text}`);
    assert.equal((await snap.call('GET', '/v1/images/gold-live')).status, 404, 'nothing made');

    // Read-only, it may: the snapshot is made from the same card.
    await snap.ok('DELETE', '/v1/volumes/goldv');
    const ro = await snap.ok('POST', '/v1/volumes', { name: 'goldro', image: 'gold', backend: 'loop', read_only: true });
    await open(`#/volumes/${ro.id}`);
    await until('a default name', async () => snapName.test(await name.inputValue()));
    await name.fill('gold-ro');
    await form.getByRole('button', { name: 'Snapshot image' }).click();
    await form.locator('.ok[role=status]').waitFor();
    assert.match(await form.locator('.ok').innerText(), /Snapshot gold-ro is being copied/);
    await readyImage('gold-ro');
    assert.equal((await snap.ok('GET', '/v1/images/gold-ro')).snapshot_of, (await snap.ok('GET', '/v1/images/gold')).id);
    await snap.ok('DELETE', '/v1/volumes/goldro');
  });

  test('cloning from an image row: the path defaults next to the source, a larger size grows the clone', async () => {
    await open('#/images');
    await imageRow('gold').getByRole('button', { name: 'Clone image gold' }).click();
    const form = tab.getByRole('form', { name: 'Clone an image' });
    assert.equal(await form.getByLabel('Source').inputValue(), (await snap.ok('GET', '/v1/images/gold')).id);
    await form.getByLabel('Clone name').fill('gold-big');
    assert.equal(await form.getByLabel('Clone path').inputValue(), `${snap.images}/gold-big.img`);
    await form.getByLabel('Clone size').fill('lots');
    await form.getByRole('button', { name: 'Clone image' }).click();
    assert.match(await form.locator('[role=alert]').innerText(), /clone size: 'lots' is not a size/);
    await form.getByLabel('Clone size').fill('1.5G');
    await form.getByRole('button', { name: 'Clone image' }).click();
    await form.locator('.ok[role=status]').waitFor();
    await readyImage('gold-big');
    const c = await snap.ok('GET', '/v1/images/gold-big');
    assert.equal(c.size_bytes, 1.5 * 2 ** 30);
    assert.equal(c.read_only, false);
    assert.equal(c.path, `${snap.images}/gold-big.img`);
    await until('the clone in the list', async () =>
      /clone of gold/.test(await imageRow('gold-big').locator('[data-field=origin]').innerText()));
  });

  test('a copy shows its progress live, is not offered for a volume, and Cancel deletes it after asking', async () => {
    await snap.imageWithData('big', 1024, 1024);
    await open('#/images');
    const form = tab.getByRole('form', { name: 'Take a snapshot' });
    await until('big offered', async () => (await form.getByLabel('Image').locator('option').allInnerTexts())
      .some((t) => t.startsWith('big ')));
    await form.getByLabel('Image').selectOption({ label: 'big (1.00 GiB)' });
    assert.match(await form.getByLabel('Snapshot name').inputValue(), /^big-snap-/);
    await form.getByLabel('Snapshot name').fill('big-s');
    await form.getByRole('button', { name: 'Take snapshot' }).click();
    await form.locator('.ok[role=status]').waitFor();
    const progress = imageRow('big-s').locator('[data-field=progress]');
    const pct = async () => Number(/(\d+)%/.exec(await progress.innerText())[1]);
    await until('some progress', async () => (await pct()) > 0);
    // Read every second while it runs (a copy's progress makes no event):
    // three different figures within 3.5 s, rising, without a reload.
    const seen = [];
    for (const end = Date.now() + 3500; Date.now() < end;) {
      const p = await pct();
      if (seen[seen.length - 1] !== p) seen.push(p);
      await tab.waitForTimeout(100);
    }
    assert.ok(seen.length >= 3 && seen.every((p, i) => !i || p > seen[i - 1]), `progress seen: ${seen}`);
    assert.equal(await imageRow('big-s').locator('progress').count(), 1, 'a progress bar');
    await screenshot(tab, 'image-copying');
    await tab.setViewportSize({ width: 390, height: 844 });
    try {
      await screenshot(tab, 'image-copying-narrow');
    } finally {
      await tab.setViewportSize({ width: 1280, height: 800 });
    }

    // The create-volume form: the copying image is not offered, saying why;
    // a snapshot holds the read-only box checked, with a note.
    await open('#/volumes');
    const vform = tab.getByRole('form', { name: 'Create a volume' });
    const option = vform.getByLabel('Image').locator('option[value="big-s"]');
    await option.waitFor({ state: 'attached' });
    assert.ok(await option.isDisabled(), 'a copying image is not offered');
    assert.match(await option.innerText(), /being copied \(\d+%\): not ready/);
    await vform.getByLabel('Image').selectOption('gold-ro');
    const roBox = vform.getByLabel('Read-only');
    assert.ok(await roBox.isChecked(), 'read-only is checked');
    assert.ok(await roBox.isDisabled(), 'and held');
    assert.match(await vform.innerText(), /gold-ro is a read-only snapshot: volumes on it are read-only/);
    await vform.getByLabel('Name').fill('rov');
    await vform.getByRole('button', { name: 'Create volume' }).click();
    await vform.locator('.ok[role=status]').waitFor();
    assert.equal((await snap.ok('GET', '/v1/volumes/rov')).read_only, true);
    await vform.getByLabel('Image').selectOption('gold');
    assert.ok(!(await roBox.isDisabled()) && !(await roBox.isChecked()), 'a writable image leaves the box free');

    await open('#/images');
    const copy = await snap.ok('GET', '/v1/images/big-s');
    assert.equal(copy.state, 'copying', 'the copy still runs');
    const cancel = imageRow('big-s').getByRole('button', { name: 'Cancel the copy of big-s' });
    await cancel.click();
    const dialog = tab.getByRole('dialog');
    await dialog.waitFor();
    assert.match(await dialog.innerText(), /Cancel the copy of big-s\?/);
    await tab.keyboard.press('Escape');
    await dialog.waitFor({ state: 'hidden' });
    assert.equal((await snap.ok('GET', '/v1/images/big-s')).state, 'copying', 'Escape leaves it running');
    await cancel.click();
    await dialog.getByRole('button', { name: 'Cancel copy' }).click();
    await imageRow('big-s').waitFor({ state: 'detached' });
    assert.equal((await snap.call('GET', '/v1/images/big-s')).status, 404);
    assert.ok(!existsSync(copy.path), 'the partial file is removed');
    const kinds = (await snap.ok('GET', '/v1/events?limit=200')).map((e) => e.kind);
    assert.ok(kinds.includes('image_copy_cancelled'), `events: ${kinds}`);
  });
});

// Encrypted images on this host: no device-mapper here, so the test covers
// the page's side (the key goes in one request and is never kept, refusals
// show the API's message); the VM tests open the plaintext.
describe('encrypted images', { concurrency: false }, () => {
  let enc;
  let tab;
  const KEY = 'dashboard-secret-key';
  const WRONG = 'dashboard-wrong-key';

  before(async () => {
    enc = await Service.start({ token: null, env: { BLOCKPLANE_KEY_UNLOCK_MS: '200' } });
    tab = await br.context.newPage();
    tab.on('pageerror', (e) => pageErrors.push(e.message));
    tab.on('request', (r) => requests.push({ url: r.url(), headers: r.headers() }));
    await tab.goto(`${enc.url}#/images`);
    await tab.locator('#live[data-state=live]').waitFor();
  });

  after(async () => {
    if (tab) await tab.close();
    if (enc) await enc.stop();
  });

  test('an image made with a key is encrypted and badged; a volume on it asks for the key, which the page never keeps', async () => {
    const form = tab.getByRole('form', { name: 'Add an image' });
    await form.getByLabel('Name').fill('vault');
    await form.getByLabel('Size').fill('24M');
    await form.getByLabel('Encryption key').fill(KEY);
    await form.getByRole('button', { name: 'Add image' }).click();
    await form.locator('.ok[role=status]').waitFor();
    assert.equal(await form.getByLabel('Encryption key').inputValue(), '', 'the key field is cleared');
    const img = await enc.ok('GET', '/v1/images/vault');
    assert.equal(img.encryption.format, 'luks2');
    const row = tab.locator('tr[data-image="vault"]');
    await row.waitFor();
    assert.match(await row.locator('[data-field=encrypted]').innerText(), /encrypted/);

    await tab.evaluate(() => { location.hash = '#/volumes'; });
    const vform = tab.getByRole('form', { name: 'Create a volume' });
    const key = vform.getByLabel('Key');
    await vform.getByLabel('Image').selectOption('vault');
    assert.ok(await key.isVisible(), 'an encrypted image asks for its key');
    await vform.getByLabel('Name').fill('vaultv');
    await vform.getByLabel('Backend').selectOption('loop');
    await key.fill(WRONG);
    await vform.getByRole('button', { name: 'Create volume' }).click();
    const alert = vform.locator('[role=alert]');
    await alert.waitFor();
    const direct = await enc.call('POST', '/v1/volumes', { name: 'vaultv', image: 'vault', backend: 'loop', key: WRONG });
    assert.equal(direct.status, 403);
    assert.equal(await alert.locator('.message').innerText(), direct.body.error.message);
    assert.equal(await key.inputValue(), '', 'the key field is cleared after the request');
    assert.equal((await enc.ok('GET', '/v1/volumes')).length, 0, 'a wrong key made nothing');

    const kept = await tab.evaluate(() => JSON.stringify({ ...localStorage, ...sessionStorage }) + document.cookie);
    for (const k of [KEY, WRONG]) {
      assert.ok(!kept.includes(k), 'the page stored a key');
      assert.ok(!requests.some((r) => r.url.includes(k)), 'a key went into a URL');
    }
    await screenshot(tab, 'encrypted-volume-refused');
  });
});

describe('backups', { concurrency: false }, () => {
  let bk;
  let tab;
  let target;

  before(async () => {
    target = mkdtempSync('/tmp/bpdash-target');
    bk = await Service.start({ token: null, env: { BLOCKPLANE_TEST_FAULT: 'slow_backup', BLOCKPLANE_BACKUP_TARGET: target } });
    tab = await br.context.newPage();
    tab.on('pageerror', (e) => pageErrors.push(e.message));
    // 64 chunks of data: a backup paced at 100 ms a chunk runs for seconds.
    await bk.imageWithData('gold', 256, 256);
    await tab.goto(`${bk.url}#/backups`);
    await tab.locator('#live[data-state=live]').waitFor();
  });

  after(async () => {
    if (tab) await tab.close();
    if (bk) await bk.stop();
    if (target) rmSync(target, { recursive: true, force: true });
  });

  test('an image is backed up with its progress shown, then restored from the list and verified', async () => {
    assert.match(await tab.locator('[data-field=backup-target]').innerText(), new RegExp(`Target: dir:${target}`));
    const form = tab.getByRole('form', { name: 'Back an image up' });
    await form.getByLabel('Image').selectOption((await bk.ok('GET', '/v1/images/gold')).id);
    const name = await form.getByLabel('Backup name').inputValue();
    assert.match(name, /^gold-\d{8}-\d{6}$/, 'the default name: image, then the time');
    await form.getByRole('button', { name: 'Back up' }).click();
    await form.locator('.ok[role=status]').waitFor();
    const row = tab.locator(`tr[data-backup="${name}"]`);
    // The progress bar while it runs, then done.
    await until('a progress bar', async () => (await row.locator('progress').count()) === 1);
    await screenshot(tab, 'backup-running');
    await until('the backup done', async () => /^done/.test(await row.locator('[data-field=state]').innerText()), 60000);
    const b = (await bk.ok('GET', '/v1/backups?image=gold'))[0];
    assert.equal(b.name, name);
    assert.match(await row.locator('[data-field=stored]').innerText(), /^256\.0 MiB/);
    // The image's 1 MiB pattern repeats: one chunk is uploaded, the others are found.
    assert.match(await row.locator('[data-field=uploaded]').innerText(), /^4(\.00?)? MiB\n252(\.0)? MiB already there/);

    await row.getByRole('button', { name: `Verify backup ${name} of gold` }).click();
    await until('the verify', async () => /all 64 chunks/.test(await tab.locator('main .outcome .ok').first().innerText()));

    await row.getByRole('button', { name: `Restore backup ${name} of gold` }).click();
    const rs = tab.getByRole('form', { name: 'Restore a backup' });
    assert.equal(await rs.getByLabel('Backup').inputValue(), b.id, 'the row chose its backup');
    await rs.getByLabel('New image name').fill('gold-back');
    assert.equal(await rs.getByLabel('New image path').inputValue(), `${bk.images}/gold-back.img`);
    await rs.getByRole('button', { name: 'Restore' }).click();
    await rs.locator('.ok[role=status]').waitFor();
    await until('the restore ready', async () => (await bk.ok('GET', '/v1/images/gold-back')).state === 'ready', 60000);
    assert.ok(readFileSync(`${bk.images}/gold-back.img`).equals(readFileSync(`${bk.images}/gold.img`)), 'the restore holds the image\'s bytes');
    await tab.evaluate(() => { location.hash = '#/images'; });
    const origin = tab.locator('tr[data-image="gold-back"] [data-field=origin]');
    await until('the origin', async () => /restored from backup/.test(await origin.innerText()));
    await screenshot(tab, 'backup-restored');
  });

  test('a schedule is made with what it keeps, shows its next run, pauses and is deleted', async () => {
    await tab.evaluate(() => { location.hash = '#/backups'; });
    const form = tab.getByRole('form', { name: 'Schedule backups of an image' });
    await form.getByLabel('Schedule name').fill('nightly');
    await form.getByLabel('Image').selectOption((await bk.ok('GET', '/v1/images/gold')).id);
    await form.getByLabel('When (cron, UTC)').fill('0 25 * * *');
    await form.getByRole('button', { name: 'Make the schedule' }).click();
    // The API's refusal, with its code.
    await until('the refusal', async () => /invalid_cron, HTTP 422/.test(await form.locator('.error').innerText()));
    await form.getByLabel('When (cron, UTC)').fill('30 2 * * *');
    await form.getByLabel('Keep weekly').fill('4');
    await form.getByLabel('Keep yearly').fill('2');
    await form.getByRole('button', { name: 'Make the schedule' }).click();
    await form.locator('.ok[role=status]').waitFor();
    const sc = await bk.ok('GET', '/v1/backup-schedules/nightly');
    assert.deepEqual(sc.retention, { keep_last: 0, keep_daily: 7, keep_weekly: 4, keep_monthly: 0, keep_yearly: 2 });
    const row = tab.locator('tr[data-schedule="nightly"]');
    await until('the row', async () => (await row.count()) === 1);
    assert.equal(await row.locator('[data-field=cron]').innerText(), '30 2 * * *');
    assert.equal(await row.locator('[data-field=keeps]').innerText(), 'daily 7, weekly 4, yearly 2');
    assert.equal(await row.locator('[data-field=last]').innerText(), 'not yet');
    assert.notEqual(await row.locator('[data-field=next]').innerText(), 'paused');
    await screenshot(tab, 'backup-schedule');
    // A schedule that names its images by a label says so.
    await bk.ok('POST', '/v1/backup-schedules', { name: 'gold-tier', selector: { tier: 'gold' }, cron: '@daily' });
    const gold = tab.locator('tr[data-schedule="gold-tier"]');
    await until('the selector row', async () => (await gold.count()) === 1);
    assert.equal(await gold.locator('[data-field=images]').innerText(), 'labelled tier=gold');
    await bk.ok('DELETE', '/v1/backup-schedules/gold-tier');

    await row.getByRole('button', { name: 'Pause schedule nightly' }).click();
    await until('paused', async () => (await row.locator('[data-field=next]').innerText()) === 'paused');
    assert.equal((await bk.ok('GET', '/v1/backup-schedules/nightly')).enabled, false);

    await row.getByRole('button', { name: 'Delete schedule nightly' }).click();
    await tab.getByRole('dialog').getByRole('button', { name: 'Delete schedule' }).click();
    await until('the row gone', async () => (await row.count()) === 0);
    assert.deepEqual(await bk.ok('GET', '/v1/backup-schedules'), []);
  });

  test('a service without a backup target says how to give it one', async () => {
    const none = await Service.start({ token: null });
    try {
      const t = await br.context.newPage();
      await t.goto(`${none.url}#/backups`);
      assert.match(await t.locator('[data-field=backup-target]').innerText(), /no backup target: start it with --backup-target/);
      await t.close();
    } finally {
      await none.stop();
    }
  });
});
