// A small SVG time-series chart: a few lines over the last minutes, a zero
// based y axis, a legend that also gives each line's latest value in text
// (the chart's text alternative). Hand-written rather than a library: the
// dashboard needs only this, and it must not fetch anything at run time.

import { h, fill } from './format.js';

const HEIGHT = 180;
const PAD = { top: 10, right: 12, bottom: 22, left: 64 };
/** Width of one character of the axis labels (12px system font), pixels. */
const CHAR_PX = 7;

/** A clock time for the time axis, e.g. 14:05:30. */
function clock(t) {
  return new Date(t).toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit', hour12: false });
}

/** The smallest "round" number (1, 2 or 5 times a power of ten) >= x. */
export function niceCeil(x) {
  if (!(x > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

/** niceCeil in binary units (KiB, MiB, ...), for byte values. */
export function niceCeilBinary(x) {
  if (!(x > 1024)) return 1024;
  const k = Math.min(Math.floor(Math.log2(x) / 10), 5);
  const unit = 2 ** (10 * k);
  return niceCeil(x / unit) * unit;
}

/** The x axis spans the samples so far: at least MIN_SPAN, at most the window. */
const MIN_SPAN_MS = 60000;

export class LineChart {
  /**
   * title: the heading; series: [{ key, label, color, dash }];
   * format: value -> text; nice: the y axis' top for a maximum;
   * windowSecs: how far back samples are kept.
   */
  constructor({ id, title, series, format, nice = niceCeil, windowSecs = 300 }) {
    this.title = title;
    this.series = series;
    this.format = format;
    this.nice = nice;
    this.windowMs = windowSecs * 1000;
    this.points = [];
    this.width = 600;
    this.svg = h('svg:svg', { role: 'img', class: 'chart-svg', height: HEIGHT });
    this.legend = h('ul', { class: 'legend' });
    this.el = h(
      'figure',
      { class: 'chart', 'data-chart': id, 'data-points': 0 },
      h('figcaption', null, title),
      this.svg,
      this.legend,
    );
    // Draw at the real width, so text keeps its size on a narrow window.
    this.resize = new ResizeObserver((entries) => {
      const w = Math.floor(entries[0].contentRect.width);
      if (w > 0 && w !== this.width) {
        this.width = w;
        this.render();
      }
    });
    this.resize.observe(this.el);
    this.render();
  }

  /** Adds one sample: values maps series keys to numbers (or null: no value). */
  push(at, values) {
    this.append([{ at, values }]);
  }

  /** Adds samples ({ at, values }, oldest first) and draws once. */
  append(samples) {
    if (!samples.length) return;
    this.points.push(...samples);
    const oldest = this.points[this.points.length - 1].at - this.windowMs;
    while (this.points.length && this.points[0].at < oldest) this.points.shift();
    this.render();
  }

  /** Replaces all samples (e.g. kept from an earlier visit of the page). */
  load(points) {
    this.points = points.slice();
    this.render();
  }

  dispose() {
    this.resize.disconnect();
  }

  render() {
    const { width: W, points } = this;
    const now = points.length ? points[points.length - 1].at : Date.now();
    const span = Math.min(this.windowMs, Math.max(MIN_SPAN_MS, points.length ? now - points[0].at : 0));
    const start = now - span;
    let max = 0;
    for (const p of points) {
      for (const s of this.series) {
        const v = p.values[s.key];
        if (v > max) max = v;
      }
    }
    const top = this.nice(max);
    const ticks = [0, top / 2, top];
    // Room for the widest y label, so "100.0 MiB/s" is never clipped.
    const left = Math.max(PAD.left, 10 + CHAR_PX * Math.max(...ticks.map((v) => this.format(v).length)));
    const plotW = Math.max(W - left - PAD.right, 10);
    const plotH = HEIGHT - PAD.top - PAD.bottom;
    const x = (t) => left + ((t - start) / span) * plotW;
    const y = (v) => PAD.top + plotH - (v / top) * plotH;

    this.svg.setAttribute('width', W);
    this.svg.setAttribute('viewBox', `0 0 ${W} ${HEIGHT}`);
    this.svg.dataset.left = left;
    const grid = ticks.map((v) =>
      h(
        'svg:g',
        { class: 'grid' },
        h('svg:line', { x1: left, x2: left + plotW, y1: y(v), y2: y(v) }),
        h('svg:text', { x: left - 6, y: y(v) + 4, 'text-anchor': 'end' }, this.format(v)),
      ),
    );
    // Clock times at both ends and the middle (three on a phone-width chart too).
    const xlabels = [
      [start, 'start'], [start + span / 2, 'middle'], [now, 'end'],
    ].map(([t, anchor]) => h('svg:text', { x: x(t), y: HEIGHT - 6, 'text-anchor': anchor, class: 'time' }, clock(t)));
    const lines = this.series.map((s, i) => {
      // Lines that coincide (all at zero, most often) stay apart by a pixel or two.
      const lift = i * 1.5;
      // A missing value breaks the line rather than drawing it as zero.
      const runs = [[]];
      for (const p of points) {
        const v = p.values[s.key];
        if (v === null || v === undefined || Number.isNaN(v)) {
          if (runs[runs.length - 1].length) runs.push([]);
        } else {
          runs[runs.length - 1].push(`${x(p.at).toFixed(1)},${(y(v) - lift).toFixed(1)}`);
        }
      }
      return runs
        .filter((r) => r.length)
        .map((r) =>
          h('svg:polyline', {
            points: r.join(' '),
            fill: 'none',
            stroke: s.color,
            'stroke-width': 2,
            'stroke-dasharray': s.dash || null,
            'data-series': s.key,
          }),
        );
    });
    fill(this.svg, h('svg:title', null, this.title), grid, xlabels, lines);

    const latest = points.length ? points[points.length - 1].values : {};
    const summary = [];
    fill(
      this.legend,
      this.series.map((s) => {
        const v = latest[s.key];
        const text = v === null || v === undefined ? 'no data' : this.format(v);
        summary.push(`${s.label} ${text}`);
        const nonzero = points.filter((p) => p.values[s.key] > 0).length;
        return h(
          'li',
          { 'data-series': s.key, 'data-nonzero': nonzero },
          h(
            'svg:svg',
            { class: 'swatch', width: 24, height: 10, 'aria-hidden': 'true' },
            h('svg:line', {
              x1: 0, x2: 24, y1: 5, y2: 5,
              stroke: s.color, 'stroke-width': 3, 'stroke-dasharray': s.dash || null,
            }),
          ),
          `${s.label}: `,
          h('span', { class: 'value' }, text),
        );
      }),
    );
    this.svg.setAttribute('aria-label', `${this.title}, latest: ${summary.join('; ')}`);
    this.el.setAttribute('data-points', points.length);
  }
}
