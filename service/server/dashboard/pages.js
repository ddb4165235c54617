// The dashboard's pages. Each page is a function (ctx, params) returning
// { el, onEvent(event), dispose() }: it loads what it shows from the API,
// reloads when an event says something changed, and shows every refusal with
// the API's own message.

import { api, seg } from './api.js';
import { LineChart, niceCeilBinary } from './chart.js';
import {
  SIZE_FORMS, bandwidth, bytes, count, fill, h, micros, parseSize, qos, sizeText, uid, when,
} from './format.js';

const OPS = ['read', 'write', 'flush', 'discard'];
// Colours with at least 4.5:1 contrast on white, told apart by dashes too.
const OP_STYLE = {
  read: { color: '#0b57d0', dash: null },
  write: { color: '#b3261e', dash: '6 3' },
  flush: { color: '#7a5900', dash: '2 3' },
  discard: { color: '#6a3fa0', dash: '10 3 2 3' },
};

/** A labelled form control; returns [wrapper, control]. */
function field(label, control, hint) {
  const id = control.id || uid('f');
  control.id = id;
  const hintEl = hint ? h('span', { class: 'hint', id: `${id}-hint` }, hint) : null;
  if (hintEl) control.setAttribute('aria-describedby', hintEl.id);
  const wrap = h('div', { class: 'field' }, h('label', { for: id }, label), control, hintEl);
  return [wrap, control];
}

function select(options, value) {
  return h(
    'select',
    null,
    options.map(([v, text]) => h('option', { value: v, selected: v === value }, text)),
  );
}

/** Where an action's outcome is shown: a success as status, a refusal as alert. */
function outcome() {
  return h('div', { class: 'outcome' });
}

/**
 * Runs one action: disables its controls meanwhile, then shows what happened
 * in `out`. Resolves to the action's result, or undefined when it failed.
 */
async function act(ctx, out, controls, fn, success) {
  // A new action makes the outcomes of earlier ones on the page stale.
  for (const o of document.querySelectorAll('main .outcome')) if (o !== out) fill(o);
  for (const c of controls) c.disabled = true;
  fill(out, h('p', { class: 'busy', role: 'status' }, 'Working…'));
  try {
    const r = await fn();
    const text = typeof success === 'function' ? success(r) : success;
    fill(out, h('p', { class: 'ok', role: 'status' }, text));
    return r;
  } catch (e) {
    showError(out, e);
    if (e.status === 401) ctx.unauthorized(e.message);
    return undefined;
  } finally {
    for (const c of controls) c.disabled = false;
  }
}

/** Shows a refusal: the API's message, then its code and status. */
function showError(out, e) {
  const where = e.status ? `${e.code}, HTTP ${e.status}` : e.code;
  fill(
    out,
    h(
      'p',
      { class: 'error', role: 'alert' },
      h('span', { class: 'message' }, e.message),
      ' ',
      h('span', { class: 'code' }, `(${where})`),
    ),
  );
}

/** A client-side refusal, shown like the API's. */
function invalid(message) {
  return Object.assign(new Error(message), { status: 0, code: 'invalid_input' });
}

/**
 * A table in a scrollable, keyboard-reachable region. Each cell carries its
 * column's name, so that a narrow window can show rows as stacked cards.
 */
function table(caption, headers, body) {
  const rows = [...body.querySelectorAll('tr')];
  // A column of numbers is right-aligned, its header with it.
  const numeric = headers.map((_, i) => rows.length > 0
    && rows.every((tr) => !tr.children[i] || tr.children[i].classList.contains('num')));
  for (const tr of rows) {
    [...tr.children].forEach((cell, i) => {
      cell.setAttribute('data-label', headers[i] ?? '');
      // One box for the content, beside the name when stacked.
      cell.append(h('div', { class: 'cell' }, ...cell.childNodes));
    });
  }
  return h(
    'div',
    { class: 'table-wrap', role: 'region', 'aria-label': caption, tabindex: 0 },
    h(
      'table',
      null,
      h('caption', null, caption),
      h('thead', null, h('tr', null, headers.map((t, i) => h('th', { scope: 'col', class: numeric[i] ? 'num' : null }, t)))),
      body,
    ),
  );
}

/** Rebuilds an element's content, keeping focus on the control with the same data-key. */
function rebuild(el, ...children) {
  const key = document.activeElement?.dataset?.key;
  fill(el, ...children);
  if (key) el.querySelector(`[data-key="${CSS.escape(key)}"]`)?.focus();
}

/** Calls fn at most once per `ms`, and once more after the last call. */
function debounce(fn, ms) {
  let timer = null;
  return () => {
    clearTimeout(timer);
    timer = setTimeout(fn, ms);
  };
}

function yesNo(b) {
  return b ? 'yes' : 'no';
}

function dispatchText(v) {
  const asked = v.requested_dispatch !== 'auto' && v.requested_dispatch !== v.dispatch
    ? ` (asked ${v.requested_dispatch})`
    : v.requested_dispatch === 'auto' ? ' (auto)' : '';
  return `${v.dispatch}${asked}`;
}

/** The build of a volume's worker: '–' without one, and whether it is older than the service's. */
function workerCell(v) {
  if (v.worker_version === null) return '–';
  return v.worker_older
    ? h('span', { class: 'warn', title: v.worker_version }, 'older build',
      h('div', { class: 'reason' }, 'blockplane upgrade moves it to the service\'s'))
    : h('span', { title: v.worker_version }, 'current');
}

function stateCell(v) {
  return h(
    'span',
    { class: `state state-${v.state}` },
    v.state,
    v.state_reason ? h('span', { class: 'reason' }, `: ${v.state_reason}`) : null,
    v.warnings?.length ? h('span', { class: 'reason', 'data-field': 'warnings' }, ` (warning: ${v.warnings.join('; ')})`) : null,
  );
}

/** Whether a host is connected to an export: `null` is the kernel not saying. */
function connectedCell(connected) {
  if (connected === null) {
    return h('span', null, 'unknown',
      h('div', { class: 'reason' }, 'the kernel cannot say (no nvmet debugfs)'));
  }
  return connected ? h('span', { class: 'yes' }, 'connected') : h('span', null, 'not connected');
}

/** Move states whose copy or release still runs: their progress is read every second. */
const MOVING = new Set(['syncing', 'releasing']);

/** A move's rate limit: 0 is none. */
function rateLimitText(n) {
  return n ? bandwidth(n) : 'none';
}

/** A remote volume's move: its state, progress bar and bytes, rate and limit. */
function moveCell(m) {
  const pct = m.total_bytes ? Math.min(100, Math.floor((100 * m.synced_bytes) / m.total_bytes)) : 0;
  return [
    h('span', { class: `state state-${m.state}`, 'data-field': 'move-state' }, m.state,
      m.state_reason ? h('span', { class: 'reason' }, `: ${m.state_reason}`) : null,
      m.state === 'syncing' ? h('progress', { max: 100, value: pct, 'aria-label': `Move of ${m.remote_name}` }) : null),
    h('div', { class: 'reason', 'data-field': 'move-progress' },
      `${pct}% (${bytes(m.synced_bytes)} of ${bytes(m.total_bytes)}) into image ${m.image}`),
    h('div', { class: 'reason' },
      m.state === 'syncing' ? h('span', { 'data-field': 'move-rate' }, bandwidth(m.rate_bytes_per_sec)) : null,
      m.state === 'syncing' ? ', ' : null,
      'limit ', h('span', { 'data-field': 'move-limit' }, rateLimitText(m.rate_limit_bytes_per_sec))),
  ];
}

/** A volume's export: what it serves where, to whom, and who is connected. */
function exportView(ex) {
  const hosts = ex.hosts.length
    ? table('Hosts allowed', ['Host NQN', 'Connected'],
      h('tbody', null, ex.hosts.map((x) => h(
        'tr',
        { 'data-host': x.host_nqn },
        h('td', { class: 'mono' }, x.host_nqn),
        h('td', { 'data-field': 'connected' }, connectedCell(x.connected)),
      ))))
    : h('p', { 'data-field': 'hosts' }, 'Any host that reaches the address may connect (no authentication, loopback only); the kernel does not list who is connected.');
  return [
    h(
      'dl',
      { class: 'facts' },
      h('dt', null, 'State'), h('dd', { 'data-field': 'export-state' }, stateCell(ex)),
      h('dt', null, 'NQN'), h('dd', { 'data-field': 'nqn', class: 'mono' }, ex.nqn),
      h('dt', null, 'Addresses'), h('dd', { 'data-field': 'addresses', class: 'mono' }, ex.addresses.join(', ') || '–'),
      h('dt', null, 'Authentication'), h('dd', { 'data-field': 'auth' }, ex.auth === 'dhchap' ? 'DH-HMAC-CHAP, both ways' : 'none'),
      h('dt', null, 'Since'), h('dd', null, when(ex.created_at)),
    ),
    hosts,
  ];
}

// ---------------------------------------------------------------- overview

/** Event kinds an operator should look at. */
const WARNING_KINDS = new Set([
  'volume_io_errors', 'volume_degraded', 'volume_error', 'worker_restarted', 'worker_recovery_failed',
  'worker_handover_failed',
  'volume_create_failed', 'volume_delete_failed', 'volume_resize_failed', 'image_overcommitted',
  'image_allocate_failed', 'orphan_found',
]);

/** Requests per second and mean latency (µs) of one volume over its last history points. */
function recent(points) {
  let secs = 0;
  let ops = 0;
  let timed = 0;
  let busy = 0;
  for (const p of points) {
    secs += p.secs;
    for (const op of OPS) {
      const n = p[op].iops * p.secs;
      ops += n;
      if (p[op].latency_us !== null) {
        timed += n;
        busy += n * p[op].latency_us;
      }
    }
  }
  return { iops: secs ? ops / secs : null, latency: timed ? busy / timed : null };
}

/** IOPS and mean latency of each attached (or degraded) volume over its last 10 s. */
async function liveFigures(volumes) {
  const live = volumes.filter((v) => v.state === 'attached' || v.state === 'degraded');
  const hist = await Promise.all(live.map((v) =>
    api('GET', `/v1/volumes/${seg(v.id)}/stats/history?seconds=10`).then((r) => r.points, () => [])));
  return live.map((v, i) => ({ v, ...recent(hist[i]) }));
}

/** Health and capacity at a glance: the page an operator opens first. */
export function overviewPage(ctx) {
  const out = outcome();
  const body = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const el = h('section', { class: 'overview' }, h('h1', { tabindex: -1 }, 'Overview'), out, body);
  let stopped = false;
  let timer = null;

  async function load() {
    let host;
    let volumes;
    let evs;
    try {
      [host, volumes, evs] = await Promise.all([
        api('GET', '/v1/host'), api('GET', '/v1/volumes'), api('GET', '/v1/events?limit=200'),
      ]);
    } catch (e) {
      showError(out, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      return;
    }
    ctx.host = host;
    const health = await api('GET', '/healthz').then(() => 'ok', (e) => `${e.code}: ${e.message}`);
    const figures = await liveFigures(volumes);
    const states = ['attached', 'degraded', 'locked', 'recovering', 'attaching', 'detaching', 'error'];
    const troubled = volumes.filter((v) => v.state === 'degraded' || v.state === 'error');
    const older = volumes.filter((v) => v.worker_older === true);
    const top = (key) => figures.filter((f) => f[key] !== null).sort((a, b) => b[key] - a[key]).slice(0, 5);
    const figureRows = (list) => h('tbody', null, list.map((f) => h('tr', { 'data-volume': f.v.name },
      h('th', { scope: 'row' }, h('a', { href: `#/volumes/${seg(f.v.id)}` }, f.v.name)),
      h('td', null, f.v.backend),
      h('td', { class: 'num' }, f.iops === null ? '–' : count(Math.round(f.iops))),
      h('td', { class: 'num' }, f.latency === null ? '–' : micros(Math.round(f.latency))))));
    const warnings = evs.filter((e) => WARNING_KINDS.has(e.kind)).slice(-10).reverse();
    fill(out);
    rebuild(
      body,
      h('dl', { class: 'facts' },
        h('dt', null, 'Service'), h('dd', { 'data-field': 'health' }, health === 'ok'
          ? h('span', { class: 'yes' }, 'healthy') : h('span', { class: 'no' }, health)),
        h('dt', null, 'Kernel'), h('dd', null, host.kernel),
        h('dt', null, 'Build'), h('dd', { 'data-field': 'build', class: 'mono' }, host.build.version,
          host.build.executable_replaced
            ? h('div', { class: 'reason warn' }, `${host.build.executable} now holds ${host.build.executable_version ?? 'nothing'}: a restart of the service runs it`)
            : null),
        h('dt', null, 'Backends here'), h('dd', null,
          ['loop', 'ublk', 'dm'].filter((b) => host.backends[b].available).join(', ') || 'none'),
        h('dt', null, 'Older workers'), h('dd', { 'data-field': 'older-workers' }, older.length
          ? [h('span', { class: 'no' }, `${count(older.length)} volume(s) served by an older build: `),
            older.map((v, i) => [i ? ', ' : '', h('a', { href: `#/volumes/${seg(v.id)}` }, v.name)]),
            h('div', { class: 'reason' }, 'blockplane upgrade hands them over, live')]
          : h('span', { class: 'yes' }, 'none: every worker runs the service\'s build'))),
      table('Image roots', ['Root', 'Size', 'Free', 'Provisioned', 'Allocated', 'Images'],
        h('tbody', null, host.image_root_capacity.map((r) => {
          const ratio = r.size_bytes ? r.provisioned_bytes / r.size_bytes : 0;
          const over = r.provisioned_bytes > r.free_bytes + r.allocated_bytes;
          return h('tr', { 'data-root': r.path },
            h('th', { scope: 'row', class: 'mono' }, r.path),
            h('td', { class: 'num' }, bytes(r.size_bytes)),
            h('td', { class: 'num' }, `${bytes(r.free_bytes)} (${Math.round((100 * r.free_bytes) / (r.size_bytes || 1))}%)`),
            h('td', { class: over ? 'num warn' : 'num' }, `${bytes(r.provisioned_bytes)} (×${ratio.toFixed(2)}${r.max_overcommit ? ` of ×${r.max_overcommit} allowed` : ''})`,
              over ? h('div', { class: 'reason' }, 'more than the free space can hold') : null),
            h('td', { class: 'num' }, bytes(r.allocated_bytes)),
            h('td', { class: 'num' }, count(r.images)));
        }))),
      table('Volumes by state', ['State', 'Volumes'],
        h('tbody', null, states.map((st) => h('tr', { 'data-state': st },
          h('th', { scope: 'row' }, st),
          h('td', { class: 'num' }, count(volumes.filter((v) => v.state === st).length)))))),
      troubled.length
        ? h('ul', { class: 'troubled' }, troubled.map((v) => h('li', { 'data-volume': v.name },
          h('a', { href: `#/volumes/${seg(v.id)}` }, v.name), ' ', stateCell(v))))
        : h('p', { class: 'hint' }, 'No volume is degraded or in error.'),
      table('Busiest volumes (last 10 s)', ['Volume', 'Backend', 'IOPS', 'Mean latency'], figureRows(top('iops'))),
      table('Slowest volumes (last 10 s)', ['Volume', 'Backend', 'IOPS', 'Mean latency'], figureRows(top('latency'))),
      h('h2', null, 'Recent warnings'),
      warnings.length ? h('ol', { class: 'events', reversed: true }, warnings.map(eventItem))
        : h('p', { class: 'hint' }, 'None in the last 200 events.'),
    );
  }

  // Figures of the last seconds: refreshed every 5 s while the page is open.
  async function tick() {
    if (stopped) return;
    await load();
    if (!stopped) timer = setTimeout(tick, 5000);
  }
  tick();
  return {
    el,
    onEvent: debounce(load, 300),
    dispose() {
      stopped = true;
      clearTimeout(timer);
    },
  };
}

// ---------------------------------------------------------------- host

/** Kernel, backends and policies (and why not), ublk features, orphans, recent events. */
export function hostPage(ctx) {
  const body = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const events = h('ol', { class: 'events', reversed: true });
  const out = outcome();
  const el = h('section', null, h('h1', { tabindex: -1 }, 'Host'), out, body,
    h('h2', null, 'Recent events'), events);

  async function load() {
    let host;
    let evs;
    try {
      [host, evs] = await Promise.all([api('GET', '/v1/host'), api('GET', '/v1/events?limit=20')]);
    } catch (e) {
      showError(out, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      return;
    }
    ctx.host = host;
    const cap = (c) => (c.available
      ? h('span', { class: 'yes' }, 'available')
      : h('span', { class: 'no' }, 'not available'));
    const backendDetail = (name, b) => {
      if (name === 'ublk' && b.features) {
        return [
          h('div', null, `features: ${b.features.names.join(', ') || 'none'}`),
          h('div', { class: 'mono' }, `mask 0x${b.features.mask.toString(16)}`),
        ];
      }
      if (name === 'dm' && b.targets) {
        return [
          h('div', null, `targets: ${b.targets.join(', ')}`),
          b.native_loop_target === null ? null
            : h('div', null, `native loop target: ${yesNo(b.native_loop_target)}`),
        ];
      }
      return null;
    };
    rebuild(
      body,
      h(
        'dl',
        { class: 'facts' },
        h('dt', null, 'Kernel'), h('dd', { 'data-field': 'kernel' }, host.kernel),
        h('dt', null, 'blockplane'), h('dd', { class: 'mono' }, host.build.version,
          host.build.executable_replaced
            ? h('div', { class: 'reason warn' }, `${host.build.executable} now holds ${host.build.executable_version ?? 'nothing'}: a restart of the service runs it`)
            : null),
        h('dt', null, 'Default backend'), h('dd', null, host.default_backend ?? 'none'),
        h('dt', null, 'Image roots'), h('dd', { class: 'mono' }, host.image_roots.join(', ')),
      ),
      table(
        'Backends',
        ['Backend', 'Available', 'Why not', 'Details'],
        h('tbody', null, ['loop', 'ublk', 'dm'].map((name) => {
          const b = host.backends[name];
          return h(
            'tr',
            { 'data-backend': name },
            h('th', { scope: 'row' }, name),
            h('td', null, cap(b)),
            h('td', null, b.reason ?? ''),
            h('td', null, backendDetail(name, b)),
          );
        })),
      ),
      table(
        'Dispatch policies (ublk and dm)',
        ['Policy', 'Available', 'Why not'],
        h('tbody', null, ['nowait', 'threaded', 'direct'].map((name) => {
          const p = host.policies[name];
          return h(
            'tr',
            { 'data-policy': name },
            h('th', { scope: 'row' }, name),
            h('td', null, cap(p)),
            h('td', null, p.reason ?? ''),
          );
        })),
      ),
      host.orphans.length
        ? table(
          'Orphan devices (made by blockplane, belong to no volume of this service)',
          ['Device', 'Backend', 'Volume id', 'Why', 'Action'],
          h('tbody', null, host.orphans.map((o) => h(
            'tr',
            null,
            h('td', { class: 'mono' }, o.device),
            h('td', null, o.backend),
            h('td', { class: 'mono' }, o.volume_id ?? ''),
            h('td', null, o.backing_file ? `${o.reason} (${o.backing_file})` : o.reason),
            h('td', null, o.removable ? h('button', {
              type: 'button',
              class: 'danger',
              'data-key': `orphan-${o.volume_id}`,
              onclick: async (ev) => {
                const ok = await ctx.confirm({
                  title: `Remove orphan ${o.device}?`,
                  text: `The ${o.backend} device ${o.device} belongs to no volume. Removing it detaches it from whatever still uses it.`,
                  action: 'Remove device',
                });
                if (!ok.ok) return;
                await act(ctx, out, [ev.currentTarget],
                  () => api('DELETE', `/v1/host/orphans/${seg(o.volume_id)}`),
                  `Orphan ${o.device} removed.`);
                load();
              },
            }, 'Remove…') : 'left to the operator'),
          ))),
        )
        : h('p', null, 'No orphan devices.'),
    );
    fill(events, evs.slice().reverse().map(eventItem));
  }
  load();
  const reload = debounce(load, 300);
  return {
    el,
    onEvent(ev) {
      events.prepend(eventItem(ev));
      while (events.children.length > 50) events.lastChild.remove();
      if (ev.kind.startsWith('orphan')) reload();
    },
    dispose() {},
  };
}

function eventItem(ev) {
  return h(
    'li',
    { 'data-event-id': ev.id, 'data-kind': ev.kind },
    h('time', { datetime: ev.at }, when(ev.at)),
    ' ',
    h('span', { class: 'kind' }, ev.kind),
    ' ',
    h('span', { class: 'message' }, ev.message),
  );
}

// ---------------------------------------------------------------- images

/** A default snapshot name: `<image>-snap-<yyyymmdd-hhmmss>` (local time). */
function snapshotName(img) {
  const d = new Date();
  const p = (n) => String(n).padStart(2, '0');
  return `${img.name}-snap-${d.getFullYear()}${p(d.getMonth() + 1)}${p(d.getDate())}-${p(d.getHours())}${p(d.getMinutes())}${p(d.getSeconds())}`;
}

/** What a snapshot or clone answer means: instant (reflink) or a copy under way. */
function copyOutcome(img, what) {
  return img.state === 'copying'
    ? `${what} ${img.name} is being copied (${bytes(img.copy_total_bytes)} of data); its progress shows on the Images page.`
    : `${what} ${img.name} made (${img.method}).`;
}

/** Percent of a copy done, 0–100. */
function copyPercent(img) {
  return img.copy_total_bytes ? Math.floor((100 * (img.copied_bytes ?? 0)) / img.copy_total_bytes) : 0;
}

/** An image's state: ready, a copy's progress bar, or why it failed. */
function imageStateCell(img) {
  if (img.state === 'copying') {
    const pct = copyPercent(img);
    return h('span', { class: 'state state-copying' }, 'copying',
      h('progress', { max: 100, value: pct, 'aria-label': `Copy of ${img.name}` }),
      h('span', { class: 'reason', 'data-field': 'progress' },
        ` ${pct}% (${bytes(img.copied_bytes ?? 0)} of ${bytes(img.copy_total_bytes)})`));
  }
  return h('span', { class: `state state-${img.state === 'failed' ? 'error' : 'ready'}` }, img.state,
    img.state_reason ? h('span', { class: 'reason' }, `: ${img.state_reason}`) : null);
}

/** Images: size, allocated, filesystem, the volumes using each; add, grow, delete. */
export function imagesPage(ctx) {
  const list = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const listOut = outcome();
  let images = [];
  let volumes = [];

  // Add an image: create a new file, or register an existing one.
  const root = ctx.host?.image_roots?.[0] ?? '';
  const [nameF, name] = field('Name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -');
  const [pathF, path] = field('Path', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false', class: 'mono' }),
    root ? `under ${ctx.host.image_roots.join(' or ')}` : null);
  let pathEdited = false;
  path.addEventListener('input', () => { pathEdited = true; });
  name.addEventListener('input', () => {
    if (!pathEdited && root) path.value = name.value ? `${root}/${name.value}.img` : '';
  });
  const modeName = uid('mode');
  const createR = h('input', { type: 'radio', name: modeName, value: 'create', id: uid('r'), checked: true });
  const registerR = h('input', { type: 'radio', name: modeName, value: 'register', id: uid('r') });
  const [sizeF, size] = field('Size', h('input', { type: 'text', value: '1G', autocomplete: 'off' }), 'e.g. 512M, 4G');
  const [allocF, alloc] = field('Allocation', select([
    ['sparse', 'sparse (allocated on write)'],
    ['full', 'full (direct-map ready)'],
  ], 'sparse'));
  // A key typed here goes in the request and nowhere else: cleared once
  // sent, whatever the answer, and never kept by the page.
  const [keyF, key] = field('Encryption key', h('input', { type: 'password', autocomplete: 'off', 'data-field': 'image-key' }),
    'optional: encrypts the new file (LUKS2; its first 16 MiB hold the header); volumes on it need this key');
  const mode = h('fieldset', { class: 'mode' }, h('legend', null, 'File'),
    h('div', null, createR, h('label', { for: createR.id }, 'Create a new file')),
    h('div', null, registerR, h('label', { for: registerR.id }, 'Register an existing file')));
  const syncMode = () => {
    const creating = createR.checked;
    size.disabled = !creating;
    alloc.disabled = !creating;
    key.disabled = !creating;
  };
  createR.addEventListener('change', syncMode);
  registerR.addEventListener('change', syncMode);
  const addBtn = h('button', { type: 'submit' }, 'Add image');
  const addOut = outcome();
  const addForm = h('form', { class: 'card', 'aria-labelledby': 'add-image-h' },
    h('h2', { id: 'add-image-h' }, 'Add an image'),
    h('div', { class: 'fields' }, nameF, pathF, mode, sizeF, allocF, keyF),
    h('div', { class: 'buttons' }, addBtn), addOut);
  addForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = { name: name.value.trim(), path: path.value.trim() };
    if (createR.checked) {
      const n = parseSize(size.value);
      if (n === null) {
        showError(addOut, invalid(`size: '${size.value}' is not a size (${SIZE_FORMS})`));
        size.focus();
        return;
      }
      body.create = { size_bytes: n, allocation: alloc.value };
      if (key.value) body.create.encryption = { key: key.value };
    }
    key.value = '';
    const r = await act(ctx, addOut, [addBtn], () => api('POST', '/v1/images', body),
      (img) => [`Image ${img.name} added: ${bytes(img.size_bytes)} on ${img.filesystem}.`,
        ...(img.allocation_reason ? [` Allocation ${img.allocation ?? 'unknown'}: ${img.allocation_reason}.`] : []),
        ...(img.warnings ?? []).map((w) => h('span', { class: 'warning' }, ` Warning: ${w}`))]);
    if (r) {
      name.value = '';
      path.value = '';
      pathEdited = false;
      load();
    }
  });

  // Grow an image.
  const [growImgF, growImg] = field('Image', h('select', null));
  const [growSizeF, growSize] = field('New size', h('input', { type: 'text', autocomplete: 'off' }),
    'larger than now; e.g. 2G');
  const growBtn = h('button', { type: 'submit' }, 'Grow image');
  const growOut = outcome();
  const growForm = h('form', { class: 'card', 'aria-labelledby': 'grow-image-h' },
    h('h2', { id: 'grow-image-h' }, 'Grow an image'),
    h('p', { class: 'hint' }, 'Attached volumes follow where their backend can resize live.'),
    h('div', { class: 'fields' }, growImgF, growSizeF),
    h('div', { class: 'buttons' }, growBtn), growOut);
  growForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const img = images.find((i) => i.id === growImg.value);
    if (!img) {
      showError(growOut, invalid('choose an image to grow'));
      return;
    }
    const n = parseSize(growSize.value);
    if (n === null) {
      showError(growOut, invalid(`new size: '${growSize.value}' is not a size (${SIZE_FORMS})`));
      growSize.focus();
      return;
    }
    const ok = await ctx.confirm({
      title: `Grow image ${img.name}?`,
      text: `From ${bytes(img.size_bytes)} to ${bytes(n)}. An image cannot shrink back.`,
      action: 'Grow image',
      danger: false,
    });
    if (!ok.ok) return;
    const r = await act(ctx, growOut, [growBtn],
      () => api('POST', `/v1/images/${seg(img.id)}/resize`, { size_bytes: n }),
      (res) => [`Image ${res.image.name} is now ${bytes(res.image.size_bytes)}.`,
        ...res.volumes.map((v) => ` Volume ${v.name}: ${v.message}`)].join(''));
    if (r) load();
  });

  // Take a snapshot: a read-only image next to the source, named by default
  // after it and the time.
  const [snapImgF, snapImg] = field('Image', h('select', null));
  const [snapNameF, snapName] = field('Snapshot name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -; the file sits next to the image\'s');
  const snapBtn = h('button', { type: 'submit' }, 'Take snapshot');
  const snapOut = outcome();
  const snapForm = h('form', { class: 'card', 'aria-labelledby': 'snap-image-h' },
    h('h2', { id: 'snap-image-h' }, 'Take a snapshot'),
    h('p', { class: 'hint' }, 'A read-only image: instant where the filesystem shares extents (xfs, btrfs), else copied in the background.'),
    h('div', { class: 'fields' }, snapImgF, snapNameF),
    h('div', { class: 'buttons' }, snapBtn), snapOut);
  snapImg.addEventListener('change', () => {
    const img = images.find((i) => i.id === snapImg.value);
    if (img) snapName.value = snapshotName(img);
  });
  snapForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const img = images.find((i) => i.id === snapImg.value);
    if (!img) {
      showError(snapOut, invalid('choose an image to snapshot'));
      return;
    }
    const r = await act(ctx, snapOut, [snapBtn],
      () => api('POST', `/v1/images/${seg(img.id)}/snapshots`, { name: snapName.value.trim() }),
      (snap) => copyOutcome(snap, 'Snapshot'));
    if (r) {
      snapName.value = snapshotName(img);
      load();
    }
  });

  // Clone: a writable image from any image, next to it by default, grown
  // to a larger size if one is given.
  const [cloneSrcF, cloneSrc] = field('Source', h('select', null));
  const [cloneNameF, cloneName] = field('Clone name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -');
  const [clonePathF, clonePath] = field('Clone path', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false', class: 'mono' }),
    'next to the source by default');
  const [cloneSizeF, cloneSize] = field('Clone size', h('input', { type: 'text', autocomplete: 'off' }),
    'optional: larger than the source, e.g. 1.5G; empty: the source\'s size');
  let clonePathEdited = false;
  clonePath.addEventListener('input', () => { clonePathEdited = true; });
  const clonePathDefault = () => {
    const img = images.find((i) => i.id === cloneSrc.value);
    if (clonePathEdited || !img) return;
    const dir = img.path.slice(0, img.path.lastIndexOf('/') + 1);
    clonePath.value = cloneName.value ? `${dir}${cloneName.value}.img` : '';
  };
  cloneName.addEventListener('input', clonePathDefault);
  cloneSrc.addEventListener('change', clonePathDefault);
  const cloneBtn = h('button', { type: 'submit' }, 'Clone image');
  const cloneOut = outcome();
  const cloneForm = h('form', { class: 'card', 'aria-labelledby': 'clone-image-h' },
    h('h2', { id: 'clone-image-h' }, 'Clone an image'),
    h('p', { class: 'hint' }, 'A writable image from any image or snapshot.'),
    h('div', { class: 'fields' }, cloneSrcF, cloneNameF, clonePathF, cloneSizeF),
    h('div', { class: 'buttons' }, cloneBtn), cloneOut);
  cloneForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const img = images.find((i) => i.id === cloneSrc.value);
    if (!img) {
      showError(cloneOut, invalid('choose an image to clone'));
      return;
    }
    const body = { name: cloneName.value.trim(), path: clonePath.value.trim(), clone_from: img.id };
    if (cloneSize.value.trim()) {
      const n = parseSize(cloneSize.value);
      if (n === null) {
        showError(cloneOut, invalid(`clone size: '${cloneSize.value}' is not a size (${SIZE_FORMS})`));
        cloneSize.focus();
        return;
      }
      body.create = { size_bytes: n };
    }
    const r = await act(ctx, cloneOut, [cloneBtn], () => api('POST', '/v1/images', body),
      (c) => copyOutcome(c, 'Clone'));
    if (r) {
      cloneName.value = '';
      clonePath.value = '';
      cloneSize.value = '';
      clonePathEdited = false;
      load();
    }
  });

  /** A row's Snapshot or Clone button: chooses the image in that form and goes to its name. */
  function startCopy(img, form, sel, nameInput, fresh) {
    sel.value = img.id;
    sel.dispatchEvent(new Event('change'));
    if (fresh) nameInput.value = fresh;
    form.scrollIntoView({ block: 'nearest' });
    nameInput.focus();
    nameInput.select();
  }

  /** Where an image comes from (snapshot or clone of which image) and its snapshots. */
  function originCell(img) {
    const nameOf = (id) => images.find((i) => i.id === id)?.name ?? id;
    const snaps = images.filter((i) => i.snapshot_of === img.id);
    return [
      img.snapshot_of ? h('div', null, 'snapshot of ', h('strong', null, nameOf(img.snapshot_of))) : null,
      img.cloned_from ? h('div', null, 'clone of ', h('strong', null, nameOf(img.cloned_from))) : null,
      img.restored_from ? h('div', { 'data-field': 'restored-from' }, 'restored from backup ', h('span', { class: 'mono' }, img.restored_from)) : null,
      img.read_only ? h('div', { class: 'badge' }, 'read-only') : null,
      img.encryption ? h('div', { class: 'badge', 'data-field': 'encrypted', title: `${img.encryption.cipher}, key slots ${img.encryption.key_slots.join(', ')}` },
        'encrypted') : null,
      img.method ? h('div', { class: 'reason' }, { reflink: 'shared extents (reflink)', copy: 'copied', restore: 'restored' }[img.method] ?? img.method) : null,
      snaps.length ? h('div', { 'data-field': 'snapshots' }, `snapshots: ${snaps.map((i) => i.name).join(', ')}`) : null,
      img.snapshot_of || img.cloned_from || img.restored_from || snaps.length || img.encryption ? null : '–',
    ];
  }

  function imageRow(img) {
    const users = img.volumes.map((id) => volumes.find((v) => v.id === id));
    const copying = img.state === 'copying';
    return h(
      'tr',
      { 'data-image': img.name },
      h('th', { scope: 'row' }, img.name, h('div', { class: 'mono path reason' }, img.path)),
      h('td', { class: 'num' }, bytes(img.size_bytes)),
      h('td', { class: 'num' }, bytes(img.allocated_bytes),
        img.allocated_bytes > img.size_bytes
          ? h('div', { class: 'reason' }, 'above the size: the filesystem\'s own blocks for the file (extent tree, preallocation)')
          : null),
      h('td', null, img.filesystem),
      h('td', null, img.allocation ?? 'registered'),
      h('td', null, users.length ? users.map((v, i) => [i ? ', ' : '',
        v ? h('a', { href: `#/volumes/${seg(v.id)}` }, v.name) : h('span', { class: 'mono' }, img.volumes[i])])
        : 'none'),
      h('td', { 'data-field': 'state' }, imageStateCell(img)),
      h('td', { 'data-field': 'origin' }, originCell(img)),
      h('td', { class: 'actions' }, img.state === 'ready' ? [h('button', {
        type: 'button',
        class: 'secondary',
        'data-key': `snapshot-image-${img.id}`,
        'aria-label': `Snapshot image ${img.name}`,
        onclick: () => startCopy(img, snapForm, snapImg, snapName, snapshotName(img)),
      }, 'Snapshot'), ' ', h('button', {
        type: 'button',
        class: 'secondary',
        'data-key': `clone-image-${img.id}`,
        'aria-label': `Clone image ${img.name}`,
        onclick: () => startCopy(img, cloneForm, cloneSrc, cloneName, null),
      }, 'Clone'), ' '] : null, copying ? h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `cancel-copy-${img.id}`,
        'aria-label': `Cancel the copy of ${img.name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          const ok = await ctx.confirm({
            title: `Cancel the copy of ${img.name}?`,
            text: `The copy stops, its partial file ${img.path} is removed and the image is forgotten.`,
            action: 'Cancel copy',
          });
          if (!ok.ok) return;
          const r = await act(ctx, listOut, [btn], () => api('DELETE', `/v1/images/${seg(img.id)}`).then(() => true),
            `The copy of ${img.name} was cancelled and its file removed.`);
          if (r !== undefined) load();
        },
      }, 'Cancel copy…') : h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `delete-image-${img.id}`,
        'aria-label': `Delete image ${img.name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          const ok = await ctx.confirm({
            title: `Delete image ${img.name}?`,
            text: `blockplane forgets the image${img.volumes.length ? ' (it refuses while volumes use it)' : ''}.`,
            check: `Also delete the file ${img.path}`,
            action: 'Delete image',
          });
          if (!ok.ok) return;
          const r = await act(ctx, listOut, [btn],
            () => api('DELETE', `/v1/images/${seg(img.id)}?delete_file=${ok.checked}`),
            `Image ${img.name} deleted${ok.checked ? ' with its file' : ''}.`);
          if (r !== undefined) load();
        },
      }, 'Delete…')),
    );
  }

  // A copy's progress makes no event: while one runs, the list is read every second.
  let copyTimer = null;
  let stopped = false;
  async function load() {
    if (stopped) return;
    try {
      [images, volumes] = await Promise.all([api('GET', '/v1/images'), api('GET', '/v1/volumes')]);
    } catch (e) {
      showError(listOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      return;
    }
    rebuild(list, images.length
      ? table('Images', ['Name', 'Size', 'Allocated', 'Filesystem', 'Allocation', 'Volumes', 'State', 'Origin', 'Action'],
        h('tbody', null, images.map(imageRow)))
      : h('p', null, 'No images yet: add one below.'));
    // Only ready images can be grown or copied; a snapshot cannot grow.
    const options = (sel, ok) => {
      const chosen = sel.value;
      fill(sel, images.filter(ok).map((i) => h('option', { value: i.id, selected: i.id === chosen }, `${i.name} (${bytes(i.size_bytes)})`)));
    };
    options(growImg, (i) => i.state === 'ready' && !i.read_only);
    const snapBefore = snapImg.value;
    options(snapImg, (i) => i.state === 'ready');
    if (snapImg.value !== snapBefore || !snapName.value) snapImg.dispatchEvent(new Event('change'));
    options(cloneSrc, (i) => i.state === 'ready');
    clearTimeout(copyTimer);
    if (images.some((i) => i.state === 'copying')) copyTimer = setTimeout(load, 1000);
  }
  load();
  const reload = debounce(load, 300);
  // Allocated bytes change with writes, which make no event.
  const timer = setInterval(load, 10000);
  const el = h('section', null, h('h1', { tabindex: -1 }, 'Images'), listOut, list,
    h('div', { class: 'cards' }, addForm, growForm, snapForm, cloneForm));
  return {
    el,
    onEvent: reload,
    dispose() {
      stopped = true;
      clearInterval(timer);
      clearTimeout(copyTimer);
    },
  };
}

// ---------------------------------------------------------------- backups

/** A default backup name: `<image>-<yyyymmdd-hhmmss>` (local time). */
function backupName(img) {
  const d = new Date();
  const p = (n) => String(n).padStart(2, '0');
  return `${img.name}-${d.getFullYear()}${p(d.getMonth() + 1)}${p(d.getDate())}-${p(d.getHours())}${p(d.getMinutes())}${p(d.getSeconds())}`;
}

/** A backup's state: done, a running one's progress bar, or why it failed. */
function backupStateCell(b) {
  if (b.state === 'running') {
    const pct = b.total_bytes ? Math.floor((100 * (b.done_bytes ?? 0)) / b.total_bytes) : 0;
    return h('span', { class: 'state state-copying' }, 'running',
      h('progress', { max: 100, value: pct, 'aria-label': `Backup ${b.name} of ${b.image_name}` }),
      h('span', { class: 'reason', 'data-field': 'progress' },
        ` ${pct}% (${bytes(b.done_bytes ?? 0)} of ${bytes(b.total_bytes ?? 0)})`));
  }
  const ok = b.state === 'done';
  return h('span', { class: `state state-${ok ? 'ready' : 'error'}` }, b.state,
    b.error ? h('span', { class: 'reason' }, `: ${b.error}`) : null);
}

/**
 * Backups on the service's target: the list (of every image, or of one),
 * a backup of an image, a restore into a new image, verify and delete.
 */
export function backupsPage(ctx) {
  const list = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const listOut = outcome();
  const target = ctx.host?.backup_target ?? null;
  let images = [];
  let backups = [];

  const [filterF, filter] = field('Show the backups of', h('select', { 'data-field': 'backup-filter' }));
  filter.addEventListener('change', () => load());

  // Back an image up now, named after it and the time by default.
  const [bkImgF, bkImg] = field('Image', h('select', null));
  const [bkNameF, bkName] = field('Backup name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -; unique among the image\'s backups');
  bkImg.addEventListener('change', () => {
    const img = images.find((i) => i.id === bkImg.value);
    if (img) bkName.value = backupName(img);
  });
  const bkBtn = h('button', { type: 'submit' }, 'Back up');
  const bkOut = outcome();
  const bkForm = h('form', { class: 'card', 'aria-labelledby': 'backup-h' },
    h('h2', { id: 'backup-h' }, 'Back an image up'),
    h('p', { class: 'hint' }, 'Its bytes at this moment, to the backup target; only the chunks the target lacks are uploaded.'),
    h('div', { class: 'fields' }, bkImgF, bkNameF),
    h('div', { class: 'buttons' }, bkBtn), bkOut);
  bkForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const img = images.find((i) => i.id === bkImg.value);
    if (!img) {
      showError(bkOut, invalid('choose an image to back up'));
      return;
    }
    const r = await act(ctx, bkOut, [bkBtn],
      () => api('POST', `/v1/images/${seg(img.id)}/backups`, { name: bkName.value.trim() }),
      (b) => `Backup ${b.name} of ${b.image_name} started; its progress shows in the list.`);
    if (r) {
      bkName.value = backupName(img);
      load();
    }
  });

  // Restore a backup into a new image, next to the first image root by default.
  const root = ctx.host?.image_roots?.[0] ?? '';
  const [rsFromF, rsFrom] = field('Backup', h('select', { 'data-field': 'restore-from' }));
  const [rsNameF, rsName] = field('New image name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -');
  const [rsPathF, rsPath] = field('New image path', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false', class: 'mono' }),
    root ? `under ${ctx.host.image_roots.join(' or ')}` : null);
  let rsPathEdited = false;
  rsPath.addEventListener('input', () => { rsPathEdited = true; });
  rsName.addEventListener('input', () => {
    if (!rsPathEdited && root) rsPath.value = rsName.value ? `${root}/${rsName.value}.img` : '';
  });
  const rsBtn = h('button', { type: 'submit' }, 'Restore');
  const rsOut = outcome();
  const rsForm = h('form', { class: 'card', 'aria-labelledby': 'restore-h' },
    h('h2', { id: 'restore-h' }, 'Restore a backup'),
    h('p', { class: 'hint' }, 'A new image, each chunk\'s hash checked; it is ready only once whole (its progress shows on the Images page).'),
    h('div', { class: 'fields' }, rsFromF, rsNameF, rsPathF),
    h('div', { class: 'buttons' }, rsBtn), rsOut);
  rsForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const b = backups.find((x) => x.id === rsFrom.value);
    if (!b) {
      showError(rsOut, invalid('choose a done backup to restore'));
      return;
    }
    const r = await act(ctx, rsOut, [rsBtn],
      () => api('POST', '/v1/images', { name: rsName.value.trim(), path: rsPath.value.trim(), restore_from: b.id }),
      (img) => [`Image ${img.name} is being restored from ${b.name} (${bytes(b.stored_bytes)} of data). `,
        h('a', { href: '#/images' }, 'Open Images')]);
    if (r) {
      rsName.value = '';
      rsPath.value = '';
      rsPathEdited = false;
    }
  });

  /** A row's Restore button: chooses the backup in the restore form. */
  function startRestore(b) {
    rsFrom.value = b.id;
    rsForm.scrollIntoView({ block: 'nearest' });
    rsName.focus();
  }

  function backupRow(b) {
    const done = b.state === 'done';
    return h('tr', { 'data-backup': b.name, 'data-image': b.image_name },
      h('th', { scope: 'row' }, b.name, h('div', { class: 'mono reason' }, b.id)),
      h('td', null, b.image_name, b.encrypted ? h('div', { class: 'badge' }, 'encrypted') : null),
      h('td', { 'data-field': 'state' }, backupStateCell(b)),
      h('td', null, when(b.created_at)),
      h('td', { class: 'num' }, bytes(b.size_bytes)),
      h('td', { class: 'num', 'data-field': 'stored' }, bytes(b.stored_bytes)),
      h('td', { class: 'num', 'data-field': 'uploaded' }, bytes(b.uploaded_bytes),
        h('div', { class: 'reason' }, `${bytes(b.deduplicated_bytes)} already there`)),
      h('td', null, b.source_host),
      h('td', { class: 'actions' }, done ? [h('button', {
        type: 'button',
        class: 'secondary',
        'data-key': `restore-${b.id}`,
        'aria-label': `Restore backup ${b.name} of ${b.image_name}`,
        onclick: () => startRestore(b),
      }, 'Restore'), ' ', h('button', {
        type: 'button',
        class: 'secondary',
        'data-key': `verify-${b.id}`,
        'aria-label': `Verify backup ${b.name} of ${b.image_name}`,
        onclick: async (ev) => {
          await act(ctx, listOut, [ev.currentTarget],
            () => api('POST', `/v1/backups/${seg(b.id)}/verify`),
            (v) => (v.ok
              ? `Backup ${b.name}: all ${v.chunks} chunks (${bytes(v.bytes)}) are there and hash right.`
              : `Backup ${b.name} is damaged: ${[...v.missing.map((c) => `chunk ${c.index} missing`), ...v.corrupt.map((c) => `chunk ${c.index} corrupt`)].join(', ')}.`));
        },
      }, 'Verify'), ' '] : null, h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `delete-backup-${b.id}`,
        'aria-label': `${b.state === 'running' ? 'Cancel' : 'Delete'} backup ${b.name} of ${b.image_name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          const running = b.state === 'running';
          const ok = await ctx.confirm({
            title: `${running ? 'Cancel' : 'Delete'} backup ${b.name} of ${b.image_name}?`,
            text: running
              ? 'The backup stops and writes no manifest; what it stored is collected later.'
              : 'It is deleted from the target; its chunks go unless another backup uses them.',
            action: running ? 'Cancel backup' : 'Delete backup',
          });
          if (!ok.ok) return;
          const r = await act(ctx, listOut, [btn], () => api('DELETE', `/v1/backups/${seg(b.id)}`).then(() => true),
            `Backup ${b.name} ${running ? 'cancelled' : 'deleted'}.`);
          if (r !== undefined) load();
        },
      }, b.state === 'running' ? 'Cancel…' : 'Delete…')));
  }

  // Backup schedules: each one's times, what it keeps, its next and last
  // runs; made, paused, resumed and deleted here.
  let schedules = [];
  const scheduleList = h('div', null);
  const scheduleOut = outcome();
  const [scNameF, scName] = field('Schedule name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, -; its backups are named after it and the time');
  const [scImgF, scImg] = field('Image', h('select', null));
  const [scCronF, scCron] = field('When (cron, UTC)', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false', value: '0 3 * * *' }),
    'minute hour day-of-month month day-of-week, or @daily, @weekly…');
  const keepInputs = ['last', 'daily', 'weekly', 'monthly', 'yearly'].map((k) => field(`Keep ${k}`,
    h('input', { type: 'number', min: 0, max: 10000, step: 1, value: k === 'daily' ? 7 : 0, 'data-keep': k })));
  const scBtn = h('button', { type: 'submit' }, 'Make the schedule');
  const scOut = outcome();
  const scForm = h('form', { class: 'card', 'aria-labelledby': 'schedule-h' },
    h('h2', { id: 'schedule-h' }, 'Schedule backups of an image'),
    h('p', { class: 'hint' }, 'After each backup, the image\'s backups are pruned: the last N kept, and the newest of each of the last N days, weeks and months. All 0: every backup is kept.'),
    h('div', { class: 'fields' }, scNameF, scImgF, scCronF, ...keepInputs.map(([f]) => f)),
    h('div', { class: 'buttons' }, scBtn), scOut);
  scForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const keep = Object.fromEntries(keepInputs.map(([, i]) => [`keep_${i.dataset.keep}`, Number(i.value) || 0]));
    const body = { name: scName.value.trim(), image: scImg.value, cron: scCron.value.trim() };
    if (Object.values(keep).some((n) => n > 0)) body.retention = keep;
    const r = await act(ctx, scOut, [scBtn], () => api('POST', '/v1/backup-schedules', body),
      (x) => `Schedule ${x.name} made; its first run is at ${when(x.next_run_at)}.`);
    if (r) load();
  });

  /** What a schedule keeps, in a few words. */
  function keeps(sc) {
    const r = sc.retention;
    if (!r) return 'every backup';
    return ['last', 'daily', 'weekly', 'monthly', 'yearly']
      .filter((k) => r[`keep_${k}`] > 0).map((k) => `${k} ${r[`keep_${k}`]}`).join(', ');
  }

  function scheduleRow(sc) {
    const run = sc.last_run;
    return h('tr', { 'data-schedule': sc.name },
      h('td', { class: 'mono' }, sc.name),
      h('td', { 'data-field': 'images' }, sc.selector
        ? `labelled ${Object.entries(sc.selector).map(([k, v]) => `${k}=${v}`).join(', ')}`
        : sc.image_name ?? h('span', { class: 'warn' }, 'image forgotten')),
      h('td', { class: 'mono', 'data-field': 'cron' }, sc.cron),
      h('td', { 'data-field': 'keeps' }, keeps(sc)),
      h('td', { 'data-field': 'next' }, sc.enabled ? when(sc.next_run_at) : 'paused'),
      h('td', { 'data-field': 'last' }, run
        ? h('span', { class: `state-${run.result}`, title: run.message ?? '' },
          `${run.result}, ${when(run.at)}`, run.message ? h('span', { class: 'hint' }, ` — ${run.message}`) : null)
        : 'not yet'),
      h('td', { class: 'num', 'data-field': 'failures' }, String(sc.consecutive_failures)),
      h('td', { class: 'actions' }, h('button', {
        type: 'button',
        'data-key': `pause-schedule-${sc.id}`,
        'aria-label': `${sc.enabled ? 'Pause' : 'Resume'} schedule ${sc.name}`,
        onclick: async (ev) => {
          const r = await act(ctx, scheduleOut, [ev.currentTarget],
            () => api('PATCH', `/v1/backup-schedules/${seg(sc.id)}`, { enabled: !sc.enabled }),
            (x) => (x.enabled ? `Schedule ${x.name} resumed; next run at ${when(x.next_run_at)}.` : `Schedule ${x.name} paused.`));
          if (r) load();
        },
      }, sc.enabled ? 'Pause' : 'Resume'), ' ', h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `delete-schedule-${sc.id}`,
        'aria-label': `Delete schedule ${sc.name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          const ok = await ctx.confirm({
            title: `Delete schedule ${sc.name}?`,
            text: 'It makes no more backups; the backups it made stay.',
            action: 'Delete schedule',
          });
          if (!ok.ok) return;
          const r = await act(ctx, scheduleOut, [btn], () => api('DELETE', `/v1/backup-schedules/${seg(sc.id)}`).then(() => true),
            `Schedule ${sc.name} deleted.`);
          if (r !== undefined) load();
        },
      }, 'Delete…')));
  }

  let runTimer = null;
  let stopped = false;
  async function load() {
    if (stopped || !target) return;
    const chosen = filter.value;
    try {
      [images, backups, schedules] = await Promise.all([api('GET', '/v1/images'),
        api('GET', `/v1/backups?${chosen ? `image=${seg(chosen)}` : ''}`), api('GET', '/v1/backup-schedules')]);
    } catch (e) {
      showError(listOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      return;
    }
    rebuild(list, backups.length
      ? table('Backups', ['Name', 'Image', 'State', 'Moment', 'Size', 'Stored', 'Uploaded', 'From host', 'Action'],
        h('tbody', null, backups.map(backupRow)))
      : h('p', null, chosen ? 'No backups of this image.' : 'No backups yet: back an image up below.'));
    rebuild(scheduleList, schedules.length
      ? table('Backup schedules', ['Name', 'Images', 'When (UTC)', 'Keeps', 'Next run', 'Last run', 'Failures', 'Action'],
        h('tbody', null, schedules.map(scheduleRow)))
      : h('p', null, 'No backup schedules: make one below.'));
    const scBefore = scImg.value;
    fill(scImg, images.map((i) => h('option', { value: i.id, selected: i.id === scBefore }, i.name)));
    fill(filter, h('option', { value: '', selected: !chosen }, 'every image'),
      images.map((i) => h('option', { value: i.id, selected: i.id === chosen }, i.name)));
    const bkBefore = bkImg.value;
    fill(bkImg, images.filter((i) => i.state === 'ready').map((i) => h('option', { value: i.id, selected: i.id === bkBefore }, `${i.name} (${bytes(i.size_bytes)})`)));
    if (bkImg.value !== bkBefore || !bkName.value) bkImg.dispatchEvent(new Event('change'));
    const rsBefore = rsFrom.value;
    fill(rsFrom, backups.filter((b) => b.state === 'done').map((b) => h('option', { value: b.id, selected: b.id === rsBefore },
      `${b.image_name} / ${b.name} (${when(b.created_at)})`)));
    clearTimeout(runTimer);
    if (backups.some((b) => b.state === 'running')) runTimer = setTimeout(load, 1000);
  }
  load();
  const reload = debounce(load, 300);
  const el = target
    ? h('section', null, h('h1', { tabindex: -1 }, 'Backups'),
      h('p', { class: 'hint', 'data-field': 'backup-target' }, `Target: ${target}`),
      h('div', { class: 'fields' }, filterF), listOut, list,
      h('div', { class: 'cards' }, bkForm, rsForm),
      h('h2', null, 'Schedules'), scheduleOut, scheduleList,
      h('div', { class: 'cards' }, scForm))
    : h('section', null, h('h1', { tabindex: -1 }, 'Backups'),
      h('p', { 'data-field': 'backup-target' }, 'This service has no backup target: start it with --backup-target DIR or s3://BUCKET/PREFIX to back images up off the host.'));
  return {
    el,
    onEvent: reload,
    dispose() {
      stopped = true;
      clearTimeout(runTimer);
    },
  };
}

// ---------------------------------------------------------------- volumes

/** Volumes: backend, policy and its reason, state, device, QoS, size; create, delete. */
export function volumesPage(ctx) {
  const list = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const remoteList = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const listOut = outcome();
  const remoteOut = outcome();
  let images = [];

  const host = ctx.host;
  const [nameF, name] = field('Name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'lowercase letters, digits, . _ -');
  const [imageF, image] = field('Image', h('select', { required: true }), 'an image serves one volume at a time');
  const backendOpts = [['auto', `auto (${host?.default_backend ?? 'best available'})`]].concat(
    ['loop', 'ublk', 'dm'].map((b) => [b, host && !host.backends[b].available ? `${b} (not available here)` : b]),
  );
  const [backendF, backend] = field('Backend', select(backendOpts, 'auto'), 'see Host for why a backend is missing');
  const [dispatchF, dispatch] = field('Dispatch policy', select(
    ['auto', 'nowait', 'threaded', 'direct', 'kernel'].map((p) => [p, p]), 'auto',
  ), 'ublk and dm only; kernel is dm only');
  const ro = h('input', { type: 'checkbox', id: uid('ro') });
  const roNote = h('p', { class: 'hint', id: uid('ro-note'), hidden: true });
  ro.setAttribute('aria-describedby', roNote.id);
  const roF = h('div', { class: 'field' }, h('div', { class: 'field check' }, ro, h('label', { for: ro.id }, 'Read-only')), roNote);
  // A read-only image (a snapshot) takes only read-only volumes: checked and held.
  let roWanted = false;
  ro.addEventListener('change', () => { roWanted = ro.checked; });
  image.addEventListener('change', () => syncReadOnly());
  function syncReadOnly() {
    const img = images.find((i) => i.name === image.value);
    const forced = Boolean(img?.read_only);
    ro.disabled = forced;
    ro.checked = forced || roWanted;
    roNote.hidden = !forced;
    fill(roNote, forced ? `${img.name} is a read-only snapshot: volumes on it are read-only.` : '');
    volKeyF.hidden = !img?.encryption;
  }
  // Shown for an encrypted image; cleared once sent, never kept by the page.
  const [volKeyF, volKey] = field('Key', h('input', { type: 'password', autocomplete: 'off', 'data-field': 'volume-key' }),
    'the encrypted image\'s key');
  const [iopsF, iops] = field('QoS IOPS limit', h('input', { type: 'number', min: 1, inputmode: 'numeric' }), 'optional; ublk');
  const [bwF, bw] = field('QoS bandwidth limit', h('input', { type: 'text', autocomplete: 'off' }), 'optional, bytes/s, e.g. 100M');
  // Dispatch and QoS need ublk or dm: on a loop-only host they are off.
  if (host && !host.backends.ublk.available && !host.backends.dm.available) {
    for (const c of [dispatch, iops, bw]) c.disabled = true;
    for (const f of [dispatchF, iopsF, bwF]) f.append(h('p', { class: 'hint' }, 'needs ublk or dm, which this host lacks (see Host)'));
  }
  const createBtn = h('button', { type: 'submit' }, 'Create volume');
  const createOut = outcome();
  const form = h('form', { class: 'card', 'aria-labelledby': 'create-volume-h' },
    h('h2', { id: 'create-volume-h' }, 'Create a volume'),
    h('div', { class: 'fields' }, nameF, imageF, volKeyF, backendF, dispatchF, iopsF, bwF, roF),
    h('div', { class: 'buttons' }, createBtn), createOut);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const body = {
      name: name.value.trim(),
      image: image.value,
      backend: backend.value,
      dispatch: dispatch.value,
      read_only: ro.checked,
    };
    const limits = {};
    if (iops.value) limits.iops = Number(iops.value);
    if (bw.value.trim()) {
      const n = parseSize(bw.value);
      if (n === null) {
        showError(createOut, invalid(`bandwidth: '${bw.value}' is not a size (${SIZE_FORMS})`));
        bw.focus();
        return;
      }
      limits.bytes_per_sec = n;
    }
    if (Object.keys(limits).length) body.qos = limits;
    if (!volKeyF.hidden && volKey.value) body.key = volKey.value;
    volKey.value = '';
    const r = await act(ctx, createOut, [createBtn], () => api('POST', '/v1/volumes', body),
      (v) => `Volume ${v.name} is ${v.state}: ${v.device ?? 'no device'} (${v.backend}).`);
    if (r) {
      fill(createOut.firstChild, `Volume ${r.name} is ${r.state}: ${r.device ?? 'no device'} (${r.backend}). `,
        h('a', { href: `#/volumes/${seg(r.id)}` }, `Open ${r.name}`));
      // Ready for the next one; the image, backend and policy choices stay.
      name.value = '';
      roWanted = false;
      iops.value = '';
      bw.value = '';
      load();
    }
  });

  function row(v) {
    return h(
      'tr',
      { 'data-volume': v.name },
      h('th', { scope: 'row' }, h('a', { href: `#/volumes/${seg(v.id)}`, 'data-key': `open-${v.id}` }, v.name)),
      h('td', { 'data-field': 'image' }, images.find((i) => i.id === v.image_id)?.name ?? v.image_id),
      h('td', { 'data-field': 'backend' }, v.backend),
      h('td', { 'data-field': 'dispatch' }, dispatchText(v), h('div', { class: 'reason' }, v.dispatch_reason)),
      h('td', { 'data-field': 'state' }, stateCell(v)),
      h('td', { 'data-field': 'device', class: 'mono' }, v.device ?? '–',
        v.encrypted ? h('div', { class: 'badge', 'data-field': 'encrypted' }, 'encrypted') : null),
      h('td', { 'data-field': 'size', class: 'num' }, bytes(v.size_bytes)),
      h('td', { 'data-field': 'read_only' }, yesNo(v.read_only)),
      h('td', { 'data-field': 'qos' }, qos(v.qos)),
      h('td', { 'data-field': 'worker' }, workerCell(v)),
      h('td', { 'data-field': 'iops', class: 'num' }, '–'),
      h('td', { 'data-field': 'latency', class: 'num' }, '–'),
      h('td', null, v.state === 'locked' ? unlockForm(v) : null, h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `delete-${v.id}`,
        'aria-label': `Delete volume ${v.name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          if (!(await confirmDelete(ctx, v))) return;
          await act(ctx, listOut, [btn], () => api('DELETE', `/v1/volumes/${seg(v.id)}`),
            `Volume ${v.name} deleted; ${v.device ?? 'its device'} is gone.`);
          load();
        },
      }, 'Delete…')),
    );
  }

  /** A locked volume's key prompt: the key goes in the request only. */
  function unlockForm(v) {
    const input = h('input', { type: 'password', autocomplete: 'off', 'aria-label': `Key of ${v.name}`, 'data-key': `unlock-key-${v.id}` });
    const btn = h('button', { type: 'submit' }, 'Unlock');
    const f = h('form', { class: 'inline', 'data-key': `unlock-${v.id}` }, input, btn);
    f.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const body = { key: input.value };
      input.value = '';
      const r = await act(ctx, listOut, [btn], () => api('POST', `/v1/volumes/${seg(v.id)}/unlock`, body),
        (u) => `Volume ${u.name} unlocked: ${u.device}.`);
      if (r) load();
    });
    return f;
  }

  /** A copying move's new rate limit: the value goes in the request, 0 or empty is none. */
  function rateForm(r, m) {
    const input = h('input', {
      type: 'text',
      autocomplete: 'off',
      placeholder: 'e.g. 50M',
      'aria-label': `New rate limit of the move of ${r.name} (bytes/s; 0: none)`,
      'data-key': `move-rate-${m.id}`,
    });
    const btn = h('button', { type: 'submit', class: 'secondary' }, 'Set limit');
    const f = h('form', { class: 'inline rate', 'data-key': `move-rate-form-${m.id}` }, input, btn);
    f.addEventListener('submit', async (ev) => {
      ev.preventDefault();
      const n = input.value.trim() ? parseSize(input.value) : 0;
      if (n === null) {
        showError(remoteOut, invalid(`rate limit: '${input.value}' is not a size (${SIZE_FORMS})`));
        input.focus();
        return;
      }
      const u = await act(ctx, remoteOut, [btn],
        () => api('PATCH', `/v1/moves/${seg(m.id)}`, { rate_limit_bytes_per_sec: n }),
        (nm) => `The move of ${r.name} now copies at ${nm.rate_limit_bytes_per_sec ? `most ${bandwidth(nm.rate_limit_bytes_per_sec)}` : 'full speed (no limit)'}.`);
      if (u) {
        input.value = '';
        load();
      }
    });
    return f;
  }

  function remoteRow(r, m) {
    const local = r.volume ? shown.find((v) => v.id === r.volume) : null;
    return h(
      'tr',
      { 'data-remote': r.name },
      h('th', { scope: 'row' }, r.name),
      h('td', { 'data-field': 'address', class: 'mono' }, r.address),
      h('td', { 'data-field': 'nqn', class: 'mono' }, r.nqn),
      h('td', { 'data-field': 'state' }, stateCell(r)),
      h('td', { 'data-field': 'device', class: 'mono' }, r.device ?? '–',
        r.nvme_device ? h('div', { class: 'reason' }, `over ${r.nvme_device}`) : null,
        r.volume ? h('div', { class: 'reason', 'data-field': 'local-volume' }, 'serves local volume ',
          h('a', { href: `#/volumes/${seg(r.volume)}` }, local?.name ?? r.volume)) : null),
      h('td', { 'data-field': 'size', class: 'num' }, bytes(r.size_bytes)),
      h('td', { 'data-field': 'read_only' }, yesNo(r.read_only)),
      h('td', { 'data-field': 'move' }, m ? moveCell(m) : '–'),
      h('td', null, m?.state === 'syncing' ? [rateForm(r, m), h('button', {
        type: 'button',
        class: 'danger',
        'data-key': `cancel-move-${m.id}`,
        'aria-label': `Cancel the move of ${r.name}`,
        onclick: async (ev) => {
          const btn = ev.currentTarget;
          const ok = await ctx.confirm({
            title: `Cancel the move of ${r.name}?`,
            text: `${r.device ?? 'The device'} serves the remote volume again, which holds every write; the new image ${m.image} goes.`,
            action: 'Cancel move',
          });
          if (!ok.ok) return;
          const c = await act(ctx, remoteOut, [btn], () => api('POST', `/v1/moves/${seg(m.id)}/cancel`),
            (x) => `Move of ${r.name}: ${x.state_reason ?? x.state}.`);
          if (c) load();
        },
      }, 'Cancel move…')] : null),
    );
  }

  // A move's progress makes no event: while one runs, its cell is read
  // again every second, in place (a rate limit being typed stays).
  let moveTimer = null;
  let stopped = false;
  let shownMoves = [];
  async function followMoves() {
    if (stopped) return;
    let moves;
    try {
      moves = await api('GET', '/v1/moves');
    } catch (e) {
      showError(remoteOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      else moveTimer = setTimeout(followMoves, 1000);
      return;
    }
    for (const was of shownMoves) {
      const m = moves.find((x) => x.id === was.id);
      // A new state brings other controls: the whole list again.
      if (!m || m.state !== was.state) {
        load();
        return;
      }
      const cell = remoteList.querySelector(`tr[data-remote="${CSS.escape(m.remote_name)}"] [data-field=move] .cell`);
      if (cell) fill(cell, moveCell(m));
    }
    moveTimer = setTimeout(followMoves, 1000);
  }

  async function load() {
    if (stopped) return;
    let volumes;
    let remotes;
    let moves;
    try {
      [volumes, images, remotes, moves] = await Promise.all(
        [api('GET', '/v1/volumes'), api('GET', '/v1/images'), api('GET', '/v1/remotes'), api('GET', '/v1/moves')],
      );
    } catch (e) {
      showError(listOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      return;
    }
    shown = volumes;
    const moveOf = (r) => moves.find((m) => m.id === r.move_id) ?? null;
    rebuild(remoteList, remotes.length
      ? table('Remote volumes (other hosts\' exports, connected here over NVMe/TCP)',
        ['Name', 'Address', 'NQN', 'State', 'Device', 'Size', 'Read-only', 'Move', 'Action'],
        h('tbody', null, remotes.map((r) => remoteRow(r, moveOf(r)))))
      : h('p', { 'data-field': 'no-remotes' }, 'No remote volumes: blockplane remote create connects another host\'s export.'));
    shownMoves = remotes.map(moveOf).filter((m) => m && MOVING.has(m.state));
    clearTimeout(moveTimer);
    if (shownMoves.length) moveTimer = setTimeout(followMoves, 1000);
    rebuild(list, volumes.length
      ? table('Volumes (IOPS and mean latency over the last 10 s)',
        ['Name', 'Image', 'Backend', 'Dispatch', 'State', 'Device', 'Size', 'Read-only', 'QoS', 'Worker', 'IOPS', 'Latency', 'Action'],
        h('tbody', null, volumes.map(row)))
      : h('p', null, 'No volumes yet: create one below.'));
    figures();
    // One image serves one volume: images in use, or still being copied, are
    // listed with why, not offered; the first free one is the default.
    const names = new Map(volumes.map((v) => [v.id, v.name]));
    const notReady = (i) => (i.state === 'copying' ? `being copied (${copyPercent(i)}%): not ready`
      : i.state === 'failed' ? `its copy failed: ${i.state_reason ?? 'see Images'}` : null);
    const free = images.filter((i) => !i.volumes?.length && !notReady(i));
    const chosen = free.some((i) => i.name === image.value) ? image.value : free[0]?.name;
    fill(image, images.length
      ? images.map((i) => {
        const users = (i.volumes ?? []).map((id) => names.get(id) ?? id);
        const why = notReady(i);
        return h('option', { value: i.name, selected: i.name === chosen, disabled: users.length > 0 || Boolean(why) },
          `${i.name} (${bytes(i.size_bytes)})${i.encryption ? ', encrypted' : ''}${i.read_only ? ', read-only snapshot' : ''}${users.length ? `, in use by ${users.join(', ')}` : ''}${why ? `, ${why}` : ''}`);
      })
      : h('option', { value: '' }, 'no images: add one on the Images page'));
    syncReadOnly();
  }
  // I/O makes no event: the figures are refreshed in place, the rows stay.
  let shown = [];
  async function figures() {
    for (const f of await liveFigures(shown)) {
      const tr = list.querySelector(`tr[data-volume="${CSS.escape(f.v.name)}"]`);
      if (!tr) continue;
      fill(tr.querySelector('[data-field=iops] .cell'), f.iops === null ? '–' : count(Math.round(f.iops)));
      fill(tr.querySelector('[data-field=latency] .cell'), f.latency === null ? '–' : micros(Math.round(f.latency)));
    }
  }
  load();
  const reload = debounce(load, 200);
  const timer = setInterval(figures, 3000);
  const el = h('section', null, h('h1', { tabindex: -1 }, 'Volumes'), listOut, list,
    h('section', { 'aria-labelledby': 'remotes-h', 'data-section': 'remotes' },
      h('h2', { id: 'remotes-h' }, 'Remote volumes'), remoteOut, remoteList),
    form);
  return {
    el,
    onEvent: reload,
    dispose() {
      stopped = true;
      clearInterval(timer);
      clearTimeout(moveTimer);
    },
  };
}

/**
 * Asks before a volume is deleted. A volume in use (open by a process,
 * mounted, or with I/O in its last seconds, as the service tells) says so
 * and wants its name typed.
 */
async function confirmDelete(ctx, v) {
  // Unknown use (e.g. the volume went meanwhile): the plain question; the delete says the rest.
  const usage = await api('GET', `/v1/volumes/${seg(v.id)}/usage`).catch(() => null);
  const busy = usage?.busy === true;
  const r = await ctx.confirm({
    title: busy ? `Volume ${v.name} is in use. Delete it?` : `Delete volume ${v.name}?`,
    text: `Its device ${v.device ?? ''} goes away; whatever uses it loses it. The image stays.`,
    warning: busy ? `In use: ${usage.reasons.join('; ')}.` : null,
    typeToConfirm: busy ? v.name : null,
    action: 'Delete volume',
  });
  return r.ok;
}

// ---------------------------------------------------------------- one volume

/** Samples kept per volume across page visits: the charts' last minutes. */
const histories = new Map();

function history(id) {
  if (!histories.has(id)) histories.set(id, { charts: {}, prev: null });
  return histories.get(id);
}

/** One volume: its settings, live changes, charts of its I/O and its events. */
export function volumePage(ctx, { id }) {
  const heading = h('h1', { tabindex: -1 }, 'Volume');
  const facts = h('dl', { class: 'facts' });
  const pageOut = outcome();
  let v = null;
  let stopped = false;

  // Live changes.
  const [dispF, disp] = field('Dispatch policy', select(
    ['auto', 'nowait', 'threaded', 'direct', 'kernel'].map((p) => [p, p]), 'auto',
  ));
  const dispBtn = h('button', { type: 'submit' }, 'Apply policy');
  const dispOut = outcome();
  const dispHint = h('p', { class: 'hint' });
  const dispForm = h('form', { class: 'card', 'aria-labelledby': 'dispatch-h' },
    h('h2', { id: 'dispatch-h' }, 'Dispatch policy'), dispHint,
    h('div', { class: 'fields' }, dispF), h('div', { class: 'buttons' }, dispBtn), dispOut);
  dispForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const r = await act(ctx, dispOut, [dispBtn],
      () => api('PATCH', `/v1/volumes/${seg(id)}`, { dispatch: disp.value }),
      (nv) => `Dispatch is now ${nv.dispatch}: ${nv.dispatch_reason}`);
    if (r) show(r);
  });

  const [qIopsF, qIops] = field('IOPS limit', h('input', { type: 'number', min: 1, inputmode: 'numeric' }), 'empty: unlimited');
  const [qBwF, qBw] = field('Bandwidth limit', h('input', { type: 'text', autocomplete: 'off' }), 'bytes/s, e.g. 100M; empty: unlimited');
  const qSet = h('button', { type: 'submit' }, 'Set limits');
  const qClear = h('button', { type: 'button', class: 'secondary' }, 'Clear limits');
  const qOut = outcome();
  const qHint = h('p', { class: 'hint' });
  const qForm = h('form', { class: 'card', 'aria-labelledby': 'qos-h' },
    h('h2', { id: 'qos-h' }, 'QoS limits'), qHint,
    h('div', { class: 'fields' }, qIopsF, qBwF), h('div', { class: 'buttons' }, qSet, qClear), qOut);
  qForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const limits = {};
    if (qIops.value) limits.iops = Number(qIops.value);
    if (qBw.value.trim()) {
      const n = parseSize(qBw.value);
      if (n === null) {
        showError(qOut, invalid(`bandwidth: '${qBw.value}' is not a size (${SIZE_FORMS})`));
        return;
      }
      limits.bytes_per_sec = n;
    }
    if (!Object.keys(limits).length) {
      showError(qOut, invalid('give an IOPS or bandwidth limit, or use Clear limits'));
      return;
    }
    const r = await act(ctx, qOut, [qSet, qClear],
      () => api('PATCH', `/v1/volumes/${seg(id)}`, { qos: limits }),
      (nv) => `QoS is now: ${qos(nv.qos)}.`);
    if (r) show(r);
  });
  qClear.addEventListener('click', async () => {
    const r = await act(ctx, qOut, [qSet, qClear],
      () => api('PATCH', `/v1/volumes/${seg(id)}`, { qos: null }),
      'QoS limits removed.');
    if (r) show(r);
  });

  const roBtn = h('button', { type: 'button', 'aria-describedby': 'ro-now' }, 'Make read-only');
  const roNow = h('p', { id: 'ro-now' });
  const roOut = outcome();
  roBtn.addEventListener('click', async () => {
    const want = !v.read_only;
    const r = await act(ctx, roOut, [roBtn],
      () => api('PATCH', `/v1/volumes/${seg(id)}`, { read_only: want }),
      (nv) => `The volume is now ${nv.read_only ? 'read-only' : 'writable'}.`);
    if (r) show(r);
  });
  const roCard = h('section', { class: 'card', 'aria-labelledby': 'ro-h' },
    h('h2', { id: 'ro-h' }, 'Read-only'), roNow, h('div', { class: 'buttons' }, roBtn), roOut);

  // Snapshot the volume's image; the service refuses where it cannot hold
  // one moment's state (its message says why).
  const [snapNameF, snapName] = field('Snapshot name', h('input', { type: 'text', autocomplete: 'off', required: true, spellcheck: 'false' }),
    'a read-only image next to this volume\'s');
  const snapBtn = h('button', { type: 'submit' }, 'Snapshot image');
  const snapOut = outcome();
  const snapForm = h('form', { class: 'card', 'aria-labelledby': 'snap-h' },
    h('h2', { id: 'snap-h' }, 'Snapshot'),
    h('div', { class: 'fields' }, snapNameF), h('div', { class: 'buttons' }, snapBtn), snapOut);
  snapForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const r = await act(ctx, snapOut, [snapBtn],
      () => api('POST', `/v1/images/${seg(v.image_id)}/snapshots`, { name: snapName.value.trim() }),
      (snap) => copyOutcome(snap, 'Snapshot'));
    if (r) {
      fill(snapOut.firstChild, copyOutcome(r, 'Snapshot'), ' ', h('a', { href: '#/images' }, 'Open Images'));
      snapName.value = '';
      load();
    }
  });

  const delBtn = h('button', { type: 'button', class: 'danger' }, 'Delete volume…');
  const delOut = outcome();
  delBtn.addEventListener('click', async () => {
    if (!(await confirmDelete(ctx, v))) return;
    const r = await act(ctx, delOut, [delBtn], () => api('DELETE', `/v1/volumes/${seg(id)}`).then(() => true),
      'Deleted.');
    if (r) ctx.navigate('#/volumes');
  });
  const delCard = h('section', { class: 'card', 'aria-labelledby': 'del-h' },
    h('h2', { id: 'del-h' }, 'Delete'),
    h('p', null, 'The device goes away; the image stays.'),
    h('div', { class: 'buttons' }, delBtn), delOut);

  // Charts: kept per volume, so coming back shows the last minutes again.
  const hist = history(id);
  const opSeries = (ops) => ops.map((op) => ({ key: op, label: op, ...OP_STYLE[op] }));
  const charts = {
    iops: new LineChart({ id: 'iops', title: 'IOPS (last 1 s)', series: opSeries(OPS), format: count }),
    bandwidth: new LineChart({
      id: 'bandwidth',
      title: 'Bandwidth (last 1 s)',
      series: opSeries(['read', 'write', 'discard']),
      format: bandwidth,
      nice: niceCeilBinary,
    }),
    mean: new LineChart({
      id: 'latency-mean',
      title: 'Mean latency (per second)',
      series: opSeries(OPS),
      format: micros,
    }),
    latency: new LineChart({
      id: 'latency',
      title: 'Latency percentiles (since the worker started)',
      series: [
        { key: 'read_p50', label: 'read p50', color: OP_STYLE.read.color, dash: null },
        { key: 'read_p99', label: 'read p99', color: OP_STYLE.read.color, dash: '6 3' },
        { key: 'write_p50', label: 'write p50', color: OP_STYLE.write.color, dash: null },
        { key: 'write_p99', label: 'write p99', color: OP_STYLE.write.color, dash: '6 3' },
        { key: 'flush_p99', label: 'flush p99', color: OP_STYLE.flush.color, dash: '2 3' },
        { key: 'discard_p99', label: 'discard p99', color: OP_STYLE.discard.color, dash: '10 3 2 3' },
      ],
      format: micros,
    }),
    events: new LineChart({
      id: 'events',
      title: 'NOWAIT fallbacks and QoS throttling (per second)',
      series: [
        { key: 'eagain', label: 'NOWAIT EAGAIN fallbacks', color: '#0b57d0', dash: null },
        { key: 'throttled', label: 'QoS-throttled requests', color: '#b3261e', dash: '6 3' },
      ],
      format: count,
    }),
  };
  // IOPS, bandwidth and mean latency come from the service's own history (it
  // keeps 15 minutes), so they open full; the ublk-only charts are derived
  // here from each stats reading and kept across visits of the page.
  const derived = ['latency', 'events'];
  for (const k of derived) if (hist.charts[k]) charts[k].load(hist.charts[k]);
  let lastAt = 0;
  function plot(points) {
    const fresh = points.map((p) => ({ ...p, at: Date.parse(p.at) })).filter((p) => p.at > lastAt);
    if (!fresh.length) return;
    lastAt = fresh[fresh.length - 1].at;
    const per = (key) => fresh.map((p) => ({ at: p.at, values: Object.fromEntries(OPS.map((op) => [op, p[op][key]])) }));
    charts.iops.append(per('iops'));
    charts.bandwidth.append(per('bytes_per_sec'));
    charts.mean.append(per('latency_us'));
  }
  const nowTable = h('div');
  const latTable = h('div');
  const cacheLine = h('p', { class: 'hint', 'data-field': 'page-cache' });
  const ublkNote = h('p', { class: 'hint', hidden: true });
  const statsOut = outcome();
  const chartsEl = h('section', { 'aria-labelledby': 'charts-h' },
    h('h2', { id: 'charts-h' }, 'I/O'), statsOut,
    h('div', { class: 'charts' }, charts.iops.el, charts.bandwidth.el, charts.mean.el, charts.latency.el, charts.events.el),
    ublkNote, nowTable, latTable, cacheLine);

  // The export, read on its own: a volume without one is the common case,
  // and a refusal to read it must not hide the rest of the page.
  const exportBody = h('div', null, h('p', { class: 'busy' }, 'Loading…'));
  const exportOut = outcome();
  const exportEl = h('section', { 'aria-labelledby': 'export-h', 'data-section': 'export' },
    h('h2', { id: 'export-h' }, 'Export (NVMe/TCP)'), exportOut, exportBody);
  let exported = false;

  const events = h('ol', { class: 'events', reversed: true });
  const eventsEl = h('section', { 'aria-labelledby': 'events-h' }, h('h2', { id: 'events-h' }, 'Events'), events);

  const el = h('section', { class: 'volume' }, heading, pageOut, facts, exportEl, chartsEl,
    h('div', { class: 'cards' }, dispForm, qForm, roCard, snapForm, delCard), eventsEl);
  // Every control acts on the loaded volume: none works before it is known.
  const controls = [dispBtn, qSet, qClear, roBtn, snapBtn, delBtn];
  for (const c of controls) c.disabled = true;

  function show(nv) {
    const first = v === null;
    v = nv;
    fill(heading, `Volume ${v.name}`);
    document.title = `${v.name} · blockplane`;
    const image = ctx.images?.find((i) => i.id === v.image_id);
    fill(
      facts,
      h('dt', null, 'State'), h('dd', { 'data-field': 'state' }, stateCell(v)),
      h('dt', null, 'Device'), h('dd', { 'data-field': 'device', class: 'mono' }, v.device ?? '–',
        v.encrypted ? h('div', { class: 'reason' }, `plaintext (dm-crypt) over ${v.backing_device ?? 'its backend\'s device'}`) : null),
      h('dt', null, 'Encrypted'), h('dd', { 'data-field': 'encrypted' }, yesNo(v.encrypted)),
      h('dt', null, 'Backend'), h('dd', { 'data-field': 'backend' }, v.backend),
      h('dt', null, 'Dispatch'), h('dd', { 'data-field': 'dispatch' }, dispatchText(v), h('div', { class: 'reason' }, v.dispatch_reason)),
      h('dt', null, 'Size'), h('dd', { 'data-field': 'size' }, bytes(v.size_bytes), v.resize_pending ? ' (resize pending: applies at the next attach)' : ''),
      h('dt', null, 'Read-only'), h('dd', { 'data-field': 'read_only' }, yesNo(v.read_only)),
      h('dt', null, 'QoS'), h('dd', { 'data-field': 'qos' }, qos(v.qos)),
      h('dt', null, 'Image'), h('dd', { 'data-field': 'image' }, image
        ? [h('a', { href: '#/images' }, image.name), ' ', h('span', { class: 'mono' }, `(${image.path})`)]
        : h('span', { class: 'mono' }, v.image_id)),
      h('dt', null, 'Queues'), h('dd', null, `${v.queues} × depth ${v.queue_depth}, requests up to ${bytes(v.max_io_bytes)}`,
        v.copy_mode ? `, ${v.copy_mode === 'zero_copy' ? 'zero copy' : 'data copied'}` : ''),
      v.direct_io === null ? null : [h('dt', null, 'Direct I/O'), h('dd', null, yesNo(v.direct_io))],
      v.worker_pid === null ? null : [h('dt', null, 'Worker'), h('dd', null, `pid ${v.worker_pid}, buffers ${bytes(v.buffer_bytes)}`)],
      v.worker_version === null ? null : [h('dt', null, 'Worker build'), h('dd', { 'data-field': 'worker', class: 'mono' }, v.worker_version, ' ', workerCell(v))],
      h('dt', null, 'Updated'), h('dd', null, when(v.updated_at)),
    );
    // Say up front what this backend cannot change live.
    const loop = v.backend === 'loop';
    fill(dispHint, loop ? 'A loop volume runs on the kernel loop driver: policies apply to ublk and dm volumes.'
      : 'Switches live, without detaching the device.');
    fill(qHint, loop ? 'QoS limits need a ublk volume.' : 'Token buckets over reads and writes together.');
    fill(roNow, `Now ${v.read_only ? 'read-only' : 'writable'}.`,
      loop ? ' The kernel loop driver cannot change this on a bound device.' : '');
    fill(roBtn, v.read_only ? 'Make writable' : 'Make read-only');
    // Controls that cannot work on this volume are off, with the reason
    // beside them (loop: the kernel driver changes none of these live).
    for (const c of controls) c.disabled = loop && c !== delBtn && c !== snapBtn;
    if (!snapName.value && image) snapName.value = snapshotName(image);
    for (const c of [disp, qIops, qBw]) c.disabled = loop;
    if (loop) fill(disp, h('option', { value: 'kernel', selected: true }, 'kernel (loop driver)'));
    if (first) {
      if (!loop) disp.value = v.requested_dispatch;
      qIops.value = v.qos?.iops ?? '';
      qBw.value = v.qos?.bytes_per_sec ? sizeText(v.qos.bytes_per_sec) : '';
    }
  }

  async function load() {
    try {
      const [nv, imgs] = await Promise.all([api('GET', `/v1/volumes/${seg(id)}`), api('GET', '/v1/images')]);
      ctx.images = imgs;
      fill(pageOut);
      show(nv);
    } catch (e) {
      showError(pageOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
    }
  }

  async function loadExport() {
    try {
      const ex = await api('GET', `/v1/volumes/${seg(id)}/export`);
      exported = true;
      fill(exportOut);
      rebuild(exportBody, ...exportView(ex));
    } catch (e) {
      exported = false;
      if (e.code !== 'export_not_found') {
        showError(exportOut, e);
        if (e.status === 401) ctx.unauthorized(e.message);
        return;
      }
      fill(exportOut);
      const fabric = ctx.host?.fabric;
      const cannot = fabric && !fabric.target.available;
      rebuild(exportBody, h('p', { 'data-field': 'export-state' }, 'Not exported.',
        cannot ? h('span', { class: 'reason' }, ` This service cannot export: ${fabric.target.reason}.`)
          : h('span', { class: 'reason' }, ' blockplane export put exports it to the hosts it names.')));
    }
  }

  async function loadEvents() {
    try {
      const evs = await api('GET', `/v1/events?volume=${seg(id)}&limit=100`);
      const have = new Set([...events.children].map((li) => li.dataset.eventId));
      for (const ev of evs) if (!have.has(String(ev.id))) events.prepend(eventItem(ev));
    } catch (e) {
      showError(pageOut, e);
    }
  }

  function sample(stats) {
    const at = Date.now();
    const lat = stats.latency_us;
    charts.latency.push(at, lat ? {
      read_p50: lat.read.p50, read_p99: lat.read.p99,
      write_p50: lat.write.p50, write_p99: lat.write.p99,
      flush_p99: lat.flush.p99, discard_p99: lat.discard.p99,
    } : {});
    // Counters since the worker started: chart their change per second.
    const prev = hist.prev;
    const rate = (now, before) => (prev && now !== null && before !== null && now >= before
      ? (now - before) / Math.max((at - prev.at) / 1000, 0.001) : null);
    const eagain = stats.nowait?.eagain_fallbacks ?? null;
    const throttled = stats.qos_throttled ?? null;
    charts.events.push(at, {
      eagain: rate(eagain, prev?.eagain ?? null),
      throttled: rate(throttled, prev?.throttled ?? null),
    });
    hist.prev = { at, eagain, throttled };
    for (const k of derived) hist.charts[k] = charts[k].points;

    const ublk = stats.latency_us !== null || stats.nowait !== null;
    charts.latency.el.hidden = !ublk;
    charts.events.el.hidden = !ublk;
    ublkNote.hidden = ublk;
    fill(ublkNote, `Latency percentiles, NOWAIT fallbacks and QoS throttling are measured by ublk workers; a ${stats.backend} volume has none (the kernel's counters give IOPS, bandwidth and the mean latency: time in queue per request).`);

    const rates = stats.rates;
    rebuild(nowTable, table(
      rates ? `Rates (IOPS and bandwidth) and totals since ${when(stats.since)}; ${count(stats.in_flight)} in flight`
        : 'Totals (rates appear after two samples)',
      ['Op', 'last 1 s', 'last 10 s', 'last 60 s', 'Total ops', 'Total bytes', 'Errors'],
      h('tbody', null, OPS.map((op) => h(
        'tr',
        { 'data-op': op },
        h('th', { scope: 'row' }, op),
        ['last_1s', 'last_10s', 'last_60s'].map((w) => h('td', { class: 'num' },
          rates ? `${count(rates[w][op].iops)} IOPS, ${bandwidth(rates[w][op].bytes_per_sec)}` : '–')),
        h('td', { class: 'num' }, count(stats[op].ops)),
        h('td', { class: 'num' }, bytes(stats[op].bytes)),
        h('td', { class: 'num' }, stats[op].errors ?? 'n/a'),
      ))),
    ));
    if (lat) {
      rebuild(latTable, table('Latency per op (µs percentiles since the worker started)',
        ['Op', 'p50', 'p90', 'p99', 'p99.9', 'max', 'requests'],
        h('tbody', null, OPS.map((op) => h(
          'tr',
          { 'data-op': op },
          h('th', { scope: 'row' }, op),
          ['p50', 'p90', 'p99', 'p999', 'max'].map((p) => h('td', { class: 'num' }, micros(lat[op][p]))),
          h('td', { class: 'num' }, count(lat[op].count)),
        )))),
      h('p', null, stats.nowait ? `NOWAIT: ${count(stats.nowait.submitted)} submitted, ${count(stats.nowait.completed_inline)} inline, ${count(stats.nowait.eagain_fallbacks)} EAGAIN fallbacks.` : null,
        stats.qos_throttled !== null ? ` QoS delayed ${count(stats.qos_throttled)} requests.` : null,
        stats.worker_restarts ? ` Worker restarts: ${count(stats.worker_restarts)}.` : null));
    } else {
      fill(latTable);
    }
    const pc = stats.page_cache;
    fill(cacheLine, pc ? `Page cache: ${pc.device_bytes !== null ? bytes(pc.device_bytes) : 'unknown'} of the device, ${pc.image_bytes !== null ? bytes(pc.image_bytes) : 'unknown'} of the image (a direct-I/O volume should hold none).` : null);
  }

  // With the service out of reach, what the page last knew is no longer
  // known: the state says so and the charts fade until it answers again.
  let unreachable = false;
  function markUnreachable(e) {
    if (unreachable || !(e.status === 0 || e.code === 'api_unreachable')) return;
    unreachable = true;
    const cell = facts.querySelector('[data-field=state]');
    if (cell) fill(cell, h('span', { class: 'state state-unknown' }, 'unknown: the service cannot be reached'));
    chartsEl.classList.add('stale');
  }

  // One stats and one history request a second while the page is open; the
  // first asks for the whole window the charts show.
  async function poll() {
    if (stopped) return;
    try {
      const seconds = lastAt ? 10 : 300;
      const [stats, history] = await Promise.all([
        api('GET', `/v1/volumes/${seg(id)}/stats`),
        api('GET', `/v1/volumes/${seg(id)}/stats/history?seconds=${seconds}`),
      ]);
      sample(stats);
      plot(history.points);
      fill(statsOut);
      if (unreachable) {
        unreachable = false;
        chartsEl.classList.remove('stale');
        load();
      }
    } catch (e) {
      showError(statsOut, e);
      if (e.status === 401) ctx.unauthorized(e.message);
      markUnreachable(e);
    }
    if (!stopped) pollTimer = setTimeout(poll, 1000);
  }
  let pollTimer = null;

  load();
  loadExport();
  loadEvents();
  poll();
  // Hosts connect and go without an event: an export is read again every
  // few seconds; a volume without one waits for the event that makes it.
  const exportTimer = setInterval(() => { if (exported) loadExport(); }, 5000);
  const reload = debounce(() => { load(); loadExport(); }, 200);
  return {
    el,
    onEvent(ev) {
      if (ev.volume_id !== v?.id && ev.volume_id !== id) return;
      if (!events.querySelector(`[data-event-id="${ev.id}"]`)) events.prepend(eventItem(ev));
      if (ev.kind === 'volume_deleted') {
        stopped = true;
        showError(pageOut, { status: 0, code: 'volume_deleted', message: ev.message });
        return;
      }
      reload();
    },
    dispose() {
      stopped = true;
      clearTimeout(pollTimer);
      clearInterval(exportTimer);
      for (const c of Object.values(charts)) c.dispose();
    },
  };
}
