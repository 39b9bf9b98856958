// E2B's JavaScript SDK (pinned in package.json) against the broker: envd's file API as an
// E2B user's code calls it (remove, rename, symlink targets, metadata, gzip, signed URLs).
// Run by protocol-tests/test_e2b_files.py (HOST_DIR: a host directory the kernel links to);
// prints one JSON line of what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create()
try {
  // Until each sandbox has a workspace of its own, a key's sandboxes share one.
  for (const n of ['jswatched', 'tree', 'a.txt', 'b.txt', 'data.csv', 'link', 'm.txt', 'g.txt', 'x.txt', 'up.txt']) {
    await sbx.files.remove(n)
  }
  // remove: a missing path is no error; a tree goes whole, a kernel's link to the host as a link.
  let removedMissing = true
  try { await sbx.files.remove('/home/user/never-was') } catch { removedMissing = false }
  await sbx.files.write('/home/user/tree/a/b.txt', 'b')
  await sbx.runCode(`import os; os.symlink(${JSON.stringify(process.env.HOST_DIR)}, 'tree/a/to-host')`)
  await sbx.files.remove('tree')
  const treeGone = !(await sbx.files.exists('tree'))
  // rename over an existing file.
  await sbx.files.write('a.txt', 'new')
  await sbx.files.write('b.txt', 'old')
  await sbx.files.rename('a.txt', 'b.txt')
  const renamed = await sbx.files.read('b.txt')
  // symlink target.
  await sbx.files.write('data.csv', 'a,b\n')
  await sbx.runCode("import os; os.symlink('data.csv', 'link')")
  const symlinkTarget = (await sbx.files.getInfo('link')).symlinkTarget
  // metadata.
  await sbx.files.write('m.txt', 'x', { metadata: { Owner: 'js' } })
  const metadata = (await sbx.files.getInfo('m.txt')).metadata
  // owner and group by name, as envd gives them.
  const info = await sbx.files.getInfo('/home/user/m.txt')
  const owner = [info.owner, info.group]
  // gzip upload.
  await sbx.files.write('g.txt', 'z'.repeat(10000), { gzip: true })
  const gz = await sbx.files.read('g.txt')
  // signed URLs, with fetch and nothing else.
  await sbx.files.write('/home/user/x.txt', 'from js')
  const signedDownload = await (await fetch(await sbx.downloadUrl('/home/user/x.txt'))).text()
  const form = new FormData()
  form.append('file', new Blob(['up from js']), 'up.txt')
  const upUrl = await sbx.uploadUrl('/home/user/up.txt', { useSignatureExpiration: 60 })
  const up = await fetch(upUrl, { method: 'POST', body: form })
  if (!up.ok) throw new Error(`signed upload: ${up.status} ${await up.text()}`)
  const signedUpload = await sbx.files.read('up.txt')
  const expired = (await fetch(await sbx.downloadUrl('x.txt', { useSignatureExpiration: -5 }))).status
  // watchDir: a recursive stream of events, with their entries.
  await sbx.files.makeDir('jswatched')
  const events = []
  let seenDeep
  const deep = new Promise((resolve) => { seenDeep = resolve })
  const handle = await sbx.files.watchDir('/home/user/jswatched', (e) => {
    events.push(e)
    if (e.name === 'in/deep.txt') seenDeep()
  }, { recursive: true, includeEntry: true })
  await sbx.files.write('jswatched/top.txt', 't')
  await sbx.runCode("import os; os.makedirs('jswatched/in'); open('jswatched/in/deep.txt', 'w').write('d')")
  await Promise.race([deep, new Promise((_, no) => setTimeout(() => no(new Error('no watch event: ' + JSON.stringify(events))), 15000))])
  await handle.stop()
  const top = events.find((e) => e.name === 'top.txt' && e.type === 'create')
  console.log(JSON.stringify({
    watched: events.map((e) => e.name),
    topEntry: top?.entry?.name ?? null,
    removedMissing, treeGone, renamed, symlinkTarget, metadata, owner, gzip: gz,
    signedDownload, signedUpload, expired,
  }))
} finally {
  await sbx.kill().catch(() => {})
}
