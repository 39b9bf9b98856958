// The open session's snapshots (issue 37; docs/API.md, "Snapshots"): take one
// (POST /v1/sessions/{id}/snapshots), see those taken of this session (GET /v1/snapshots,
// the caller's only), start a new session from one (POST /v1/sessions {"snapshot"}) and
// delete one. A snapshot's name is the user's text: drawn as text only, as everything is.
'use strict';

KB.snapshots = (function () {
  const { el, clip, when, bytes } = KB;
  // At most this many are drawn (a user keeps at most 32).
  const MAX_SHOWN = 32;

  // The panel of session `id`: `el`, its element (hidden while the session has none);
  // `refresh()` asks for its snapshots again; `take()` takes one. `api(path, opts)` is the
  // page's authenticated fetch (it throws with the broker's message on a refusal), `say(text,
  // isError)` its status line, `opened(session)` shows a session the panel made, `others()`
  // the page's buttons that wait with the panel's (the session's actions).
  function panel(id, api, say, opened, others) {
    const short = id.slice(0, 8);
    const list = el('ul', { class: 'snapshot-list' });
    const box = el('div', { class: 'snapshots', id: 'snapshots', hidden: true },
      el('span', { class: 'label', text: 'snapshots' }), list);
    const buttons = () => [...box.querySelectorAll('button'), ...others()];
    // Every button of the panel waits for the answer; a refusal is shown, nothing is lost.
    async function busy(what, work) {
      for (const b of buttons()) b.disabled = true;
      box.dataset.busy = what;
      try {
        await work();
      } catch (e) {
        say(what + ' failed: ' + e.message, true);
      } finally {
        for (const b of buttons()) b.disabled = false;
        delete box.dataset.busy;
        refresh();
      }
    }

    function item(s) {
      const label = s.name || s.snapshot_id.slice(0, 8);
      const facts = 'taken ' + when(s.created_at) + ' after step ' + s.execution_count +
        (typeof s.image_bytes === 'number' ? ', ' + bytes(s.image_bytes) + ' on disk' : '');
      return el('li', { 'data-snapshot': s.snapshot_id },
        el('span', { class: 'name', text: clip(label, 128), title: facts }),
        el('button', { type: 'button', class: 'start-snapshot', title: 'A new session from this snapshot, with its state', onclick: () => start(s, label), text: 'start' }),
        el('button', { type: 'button', class: 'delete-snapshot danger', title: 'Delete this snapshot', onclick: () => remove(s, label), text: 'delete' }));
    }

    async function refresh() {
      let mine = [];
      try {
        const all = await (await api('v1/snapshots')).json();
        mine = (Array.isArray(all) ? all : [])
          .filter((s) => s && s.session_id === id && typeof s.snapshot_id === 'string');
      } catch (_) {
        // The caller's snapshots could not be read now: none offered, nothing of the page's.
      }
      if (box.dataset.busy) return;
      list.replaceChildren(...mine.slice(-MAX_SHOWN).map(item));
      box.hidden = mine.length === 0;
    }

    function take() {
      const name = window.prompt('Name the snapshot of session ' + short + ' (optional; letters, digits and -_.:/)', '');
      if (name === null) return Promise.resolve();
      return busy('snapshot', async () => {
        say('taking a snapshot of ' + short + '…');
        const body = name.trim() ? { name: name.trim() } : {};
        const s = await (await api('v1/sessions/' + id + '/snapshots', {
          method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
        })).json();
        say('snapshot ' + clip(s.name || s.snapshot_id.slice(0, 8), 128) + ' of ' + short + ' taken (' + bytes(s.image_bytes) + ')');
      });
    }

    function start(s, label) {
      return busy('start', async () => {
        say('starting a session from snapshot ' + clip(label, 128) + '…');
        const made = await (await api('v1/sessions', {
          method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ snapshot: s.snapshot_id }),
        })).json();
        if (!made || typeof made.id !== 'string') throw new Error('the broker did not answer a session');
        say('session ' + made.id.slice(0, 8) + ' started from snapshot ' + clip(label, 128));
        opened(made);
      });
    }

    function remove(s, label) {
      if (!window.confirm('Delete snapshot ' + clip(label, 128) + '? Sessions started from it go on.')) return Promise.resolve();
      return busy('delete', async () => {
        await api('v1/snapshots/' + encodeURIComponent(s.snapshot_id), { method: 'DELETE' });
        say('snapshot ' + clip(label, 128) + ' deleted');
      });
    }

    return { el: box, refresh, take };
  }

  return { panel };
})();
