// The dashboard's shell: sign-in, navigation between pages (hash routes, so
// the service serves one page), the live event stream, and the confirmation
// dialog for destructive actions.

import { api, eventStream, setToken, token } from './api.js';
import { fill, h } from './format.js';
import {
  backupsPage, hostPage, imagesPage, overviewPage, volumePage, volumesPage,
} from './pages.js';

const $ = (id) => document.getElementById(id);

const ctx = {
  host: null,
  images: null,
  confirm,
  navigate(hash) {
    if (location.hash === hash) route();
    else location.hash = hash;
  },
  unauthorized(message) {
    showLogin(message);
  },
};

let page = null;
let stream = null;

const ROUTES = [
  [/^#\/overview$/, () => overviewPage(ctx), 'overview'],
  [/^#\/host$/, () => hostPage(ctx), 'host'],
  [/^#\/images$/, () => imagesPage(ctx), 'images'],
  [/^#\/backups$/, () => backupsPage(ctx), 'backups'],
  [/^#\/volumes$/, () => volumesPage(ctx), 'volumes'],
  [/^#\/volumes\/([^/]+)$/, (m) => volumePage(ctx, { id: decodeURIComponent(m[1]) }), 'volumes'],
];

function route() {
  if ($('app').hidden) return;
  const hash = location.hash || '#/overview';
  let found = null;
  for (const [re, make, nav] of ROUTES) {
    const m = re.exec(hash);
    if (m) {
      found = { make: () => make(m), nav };
      break;
    }
  }
  if (page) page.dispose();
  page = null;
  const main = $('main');
  if (!found) {
    fill(main, h('h1', { tabindex: -1 }, 'Not found'),
      h('p', null, 'No such page. ', h('a', { href: '#/volumes' }, 'Go to the volumes')));
    return;
  }
  page = found.make();
  fill(main, page.el);
  document.title = `${found.nav[0].toUpperCase()}${found.nav.slice(1)} · blockplane`;
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.dataset.nav === found.nav) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  // After a user's navigation, start reading at the new page's heading.
  if (navigated) main.querySelector('h1')?.focus();
}

let navigated = false;
window.addEventListener('hashchange', () => {
  navigated = true;
  route();
});

function setLive(state, detail) {
  const el = $('live');
  el.dataset.state = state;
  fill(el, {
    connecting: 'Connecting to events…',
    live: 'Live',
    down: `Events interrupted (${detail}); retrying…`,
    unauthorized: 'Not signed in',
  }[state] ?? state);
}

function connectEvents() {
  if (stream) stream.close();
  stream = eventStream({
    onEvent: (ev) => page?.onEvent(ev),
    onState: (state, detail) => {
      setLive(state, detail);
      if (state === 'unauthorized') showLogin('The service refused the token for the event stream.');
    },
  });
}

function showLogin(message) {
  if (stream) stream.close();
  stream = null;
  if (page) page.dispose();
  page = null;
  $('app').hidden = true;
  $('login').hidden = false;
  fill($('login-error'), message ? h('p', { class: 'error', role: 'alert' }, message) : null);
  $('token').value = '';
  $('token').focus();
}

async function start() {
  let host;
  try {
    host = await api('GET', '/v1/host');
  } catch (e) {
    if (e.status === 401) {
      showLogin(token() ? `The service refused this token: ${e.message}` : null);
    } else {
      $('login').hidden = true;
      $('app').hidden = false;
      fill($('main'), h('h1', null, 'Cannot load the dashboard'),
        h('p', { class: 'error', role: 'alert' }, `${e.message} (${e.code})`),
        h('button', { type: 'button', onclick: start }, 'Try again'));
    }
    return;
  }
  ctx.host = host;
  $('login').hidden = true;
  $('app').hidden = false;
  $('signout').hidden = !token();
  connectEvents();
  route();
}

$('login-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  setToken($('token').value.trim());
  start();
});

$('signout').addEventListener('click', () => {
  setToken('');
  showLogin('Signed out.');
});

/**
 * Asks before a destructive action. opts: { title, text, action, check, danger }.
 * Resolves to { ok, checked }; Cancel has the focus, Escape cancels.
 */
function confirm(opts) {
  const dlg = $('confirm');
  fill($('confirm-title'), opts.title);
  fill($('confirm-text'), opts.text);
  const ok = $('confirm-ok');
  fill(ok, opts.action);
  ok.className = opts.danger === false ? '' : 'danger';
  const check = $('confirm-check');
  check.checked = false;
  $('confirm-check-row').hidden = !opts.check;
  fill($('confirm-check-label'), opts.check ?? '');
  const warning = $('confirm-warning');
  warning.hidden = !opts.warning;
  fill(warning, opts.warning ?? '');
  // A word to type before the action is allowed (a volume in use: its name).
  const typed = $('confirm-type');
  typed.value = '';
  $('confirm-type-row').hidden = !opts.typeToConfirm;
  fill($('confirm-type-label'), opts.typeToConfirm ? `Type ${opts.typeToConfirm} to confirm` : '');
  const allow = () => { ok.disabled = Boolean(opts.typeToConfirm) && typed.value !== opts.typeToConfirm; };
  allow();
  typed.oninput = allow;
  // Enter in the field means the action, never the form's first button (Cancel).
  typed.onkeydown = (e) => {
    if (e.key !== 'Enter') return;
    e.preventDefault();
    if (!ok.disabled) ok.click();
  };
  dlg.returnValue = '';
  const opener = document.activeElement;
  dlg.showModal();
  (opts.typeToConfirm ? typed : $('confirm-cancel')).focus();
  return new Promise((resolve) => {
    dlg.addEventListener('close', () => {
      ok.disabled = false;
      opener?.focus?.();
      resolve({ ok: dlg.returnValue === 'ok', checked: check.checked });
    }, { once: true });
  });
}

start();
