// Turning API values into text, and building DOM elements without innerHTML
// (every value shown comes from the API and is inserted as text).

const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** Bytes in binary units, e.g. "1.5 GiB". */
export function bytes(n) {
  if (n === null || n === undefined) return '–';
  let x = Number(n);
  let u = 0;
  while (Math.abs(x) >= 1024 && u < UNITS.length - 1) {
    x /= 1024;
    u += 1;
  }
  return u === 0 ? `${Math.round(x)} B` : `${x.toFixed(x < 10 ? 2 : 1)} ${UNITS[u]}`;
}

/** A rate in bytes per second. */
export function bandwidth(n) {
  return `${bytes(n)}/s`;
}

/** A count with at most one decimal, thousands grouped. */
export function count(n) {
  if (n === null || n === undefined) return '–';
  const x = Number(n);
  return x.toLocaleString('en-US', { maximumFractionDigits: x < 10 ? 1 : 0 });
}

/** Microseconds as µs, ms or s. */
export function micros(n) {
  if (n === null || n === undefined) return '–';
  if (n < 1000) return `${Math.round(n)} µs`;
  if (n < 1e6) return `${(n / 1000).toFixed(n < 1e4 ? 2 : 1)} ms`;
  return `${(n / 1e6).toFixed(2)} s`;
}

/** What parseSize reads, for refusals. */
export const SIZE_FORMS = 'bytes, or e.g. 512M, 1.5G, 4GiB (binary: 1024) or 500MB, 2GB (decimal: 1000)';

/**
 * Parses a size as the CLI does: bytes, or a number (fractions allowed) with
 * a unit: K, M, G, T / Ki, Mi... / KiB, MiB... are binary (1024), KB, MB, GB,
 * TB decimal (1000). Returns null for anything else or a fraction of a byte.
 */
export function parseSize(text) {
  const m = /^\s*(\d*)(?:\.(\d+))?\s*([a-zA-Z]*)\s*$/.exec(String(text));
  if (!m || (m[1] === '' && m[2] === undefined)) return null;
  const mult = {
    '': 1, B: 1,
    K: 2 ** 10, k: 2 ** 10, Ki: 2 ** 10, KiB: 2 ** 10,
    M: 2 ** 20, Mi: 2 ** 20, MiB: 2 ** 20,
    G: 2 ** 30, Gi: 2 ** 30, GiB: 2 ** 30,
    T: 2 ** 40, Ti: 2 ** 40, TiB: 2 ** 40,
    KB: 1e3, kB: 1e3, MB: 1e6, GB: 1e9, TB: 1e12,
  }[m[3]];
  if (mult === undefined) return null;
  const frac = m[2] ?? '';
  const scale = 10n ** BigInt(frac.length);
  const bytes = BigInt(`${m[1]}${frac}` || '0') * BigInt(mult);
  if (bytes % scale !== 0n) return null;
  const n = Number(bytes / scale);
  return Number.isSafeInteger(n) ? n : null;
}

/** A size as the shortest exact text parseSize reads back, e.g. 1073741824 -> "1G". */
export function sizeText(n) {
  for (const [unit, mult] of [['T', 2 ** 40], ['G', 2 ** 30], ['M', 2 ** 20], ['K', 2 ** 10]]) {
    if (n >= mult && n % mult === 0) return `${n / mult}${unit}`;
  }
  return String(n);
}

/** A time stamp in the browser's locale, to the second. */
export function when(iso) {
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
}

/** QoS limits as one line. */
export function qos(q) {
  if (!q) return 'none';
  const parts = [];
  if (q.iops) parts.push(`${count(q.iops)} IOPS`);
  if (q.bytes_per_sec) parts.push(bandwidth(q.bytes_per_sec));
  if (q.burst_iops) parts.push(`burst ${count(q.burst_iops)} IOPS`);
  if (q.burst_bytes) parts.push(`burst ${bytes(q.burst_bytes)}`);
  return parts.length ? parts.join(', ') : 'none';
}

/**
 * Creates an element: h('a', { href: '#/x', class: 'y' }, 'text', child).
 * Attributes named on* take a listener; false/null/undefined ones are left
 * out; children may be strings, nodes, arrays or null.
 */
export function h(tag, attrs, ...children) {
  const svg = tag.startsWith('svg:');
  const el = svg
    ? document.createElementNS('http://www.w3.org/2000/svg', tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k.startsWith('on') && typeof v === 'function') {
      el.addEventListener(k.slice(2), v);
    } else if (k === 'value' && !svg) {
      el.value = v;
    } else {
      el.setAttribute(k, v === true ? '' : String(v));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : String(c));
  }
}

/** Replaces an element's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

let ids = 0;
/** A unique element id, for label/for pairs. */
export function uid(prefix) {
  ids += 1;
  return `${prefix}-${ids}`;
}
