// The dashboard's only way to the service: the public API, same origin, with
// the user's bearer token. The token lives in sessionStorage (gone with the
// tab) and only ever travels in the Authorization header, never in a URL.

const TOKEN_KEY = 'blockplane.token';

/** The stored token, or '' when none was given. */
export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || '';
}

/** Stores the token for this tab ('' forgets it). */
export function setToken(t) {
  if (t) sessionStorage.setItem(TOKEN_KEY, t);
  else sessionStorage.removeItem(TOKEN_KEY);
}

function headers(extra) {
  const h = { ...extra };
  const t = token();
  if (t) h.authorization = `Bearer ${t}`;
  return h;
}

/** An error answer of the API (or a failure to reach it: status 0). */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Path segment encoding for ids and names. */
export const seg = encodeURIComponent;

/**
 * Calls the API; resolves to the answer's JSON (null when empty), rejects
 * with an ApiError carrying the API's own code and message.
 */
export async function api(method, path, body) {
  let resp;
  try {
    resp = await fetch(path, {
      method,
      headers: headers(body === undefined ? {} : { 'content-type': 'application/json' }),
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
    });
  } catch (e) {
    throw new ApiError(0, 'unreachable', `cannot reach the blockplane service: ${e.message}`);
  }
  const text = await resp.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }
  if (!resp.ok) {
    const err = data && typeof data === 'object' ? data.error : null;
    throw new ApiError(
      resp.status,
      err?.code ?? `http_${resp.status}`,
      err?.message ?? `HTTP ${resp.status} ${resp.statusText}: ${String(text).slice(0, 300)}`,
    );
  }
  return data;
}

/**
 * Follows GET /v1/events/stream. EventSource cannot send an Authorization
 * header, so this reads the stream with fetch and parses Server-Sent Events
 * itself; after a drop it reconnects with Last-Event-ID, so no event is lost.
 *
 * onEvent(event) gets each event's JSON; onState(state, detail) hears
 * 'connecting', 'live', 'down' (detail: why; it retries) and 'unauthorized'
 * (it stops). Returns { close() }.
 */
export function eventStream({ onEvent, onState }) {
  let lastId = null;
  let stopped = false;
  let controller = null;
  let delay = 1000;
  let timer = null;

  async function connect() {
    if (stopped) return;
    onState('connecting');
    controller = new AbortController();
    const h = headers({ accept: 'text/event-stream' });
    if (lastId !== null) h['last-event-id'] = String(lastId);
    let reason = 'the stream ended';
    try {
      const resp = await fetch('/v1/events/stream', {
        headers: h,
        signal: controller.signal,
        cache: 'no-store',
      });
      if (resp.status === 401) {
        onState('unauthorized');
        return;
      }
      if (!resp.ok || !resp.body) {
        const body = await resp.text().catch(() => '');
        let msg = `HTTP ${resp.status}`;
        try {
          msg = JSON.parse(body).error.message;
        } catch {
          /* not the API's JSON: keep the status */
        }
        throw new Error(msg);
      }
      onState('live');
      delay = 1000;
      await read(resp.body);
    } catch (e) {
      if (stopped) return;
      reason = e.message;
    }
    if (stopped) return;
    onState('down', reason);
    timer = setTimeout(connect, delay);
    delay = Math.min(delay * 2, 10000);
  }

  async function read(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    let ev = { id: null, data: [] };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      // Lines end with CRLF, LF or CR; the last piece may be incomplete.
      const lines = buf.split(/\r\n|\r|\n/);
      buf = lines.pop();
      for (const line of lines) {
        if (line === '') {
          if (ev.id !== null) lastId = ev.id;
          if (ev.data.length) dispatch(ev.data.join('\n'));
          ev = { id: null, data: [] };
          continue;
        }
        if (line.startsWith(':')) continue; // keep-alive comment
        const i = line.indexOf(':');
        const field = i < 0 ? line : line.slice(0, i);
        let v = i < 0 ? '' : line.slice(i + 1);
        if (v.startsWith(' ')) v = v.slice(1);
        if (field === 'data') ev.data.push(v);
        else if (field === 'id') ev.id = v;
        // `event` repeats the JSON's kind; `retry` is ours to choose.
      }
    }
  }

  function dispatch(data) {
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      return;
    }
    onEvent(event);
  }

  connect();
  return {
    close() {
      stopped = true;
      clearTimeout(timer);
      if (controller) controller.abort();
    },
  };
}
