// E2B's JavaScript SDK (pinned in package.json) against the broker: an E2B sandbox's shape
// (home /home/user, a workspace and /tmp of its own, the user `user`, any working
// directory, sudo refused) as an E2B user's code uses it. Run by
// protocol-tests/test_e2b_shape.py; prints one JSON line of what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const CSV = 'a,b\n1,2\n3,4\n'
const outcome = async (f) => {
  try {
    await f()
    return 'returned'
  } catch (e) {
    return `refused: ${e.name}: ${e.message}`
  }
}

const sbx = await Sandbox.create()
const other = await Sandbox.create()
try {
  await sbx.files.write('/home/user/data.csv', CSV)
  await sbx.runCode("import pandas as pd; df = pd.read_csv('/home/user/data.csv')")
  const rows = await sbx.runCode('print(len(df))')
  const read = await sbx.files.read('data.csv')
  const viaWorkspace = await sbx.files.read('/workspace/data.csv')
  const pwd = await sbx.commands.run('pwd; echo $HOME')
  const whoami = await sbx.commands.run('whoami')
  await sbx.commands.run('echo hi >/tmp/x')
  const tmp = await sbx.commands.run('cat /tmp/x')
  const tmpKernel = await sbx.runCode("print(open('/tmp/x').read().strip())")
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  const ctxCwd = await sbx.runCode('import os; print(os.getcwd())', { context: ctx })
  const cmdCwd = await sbx.commands.run('pwd', { cwd: '/tmp' })
  const missingCwd = await outcome(() => sbx.createCodeContext({ cwd: '/home/user/missing' }))
  let sudo
  try {
    await sbx.commands.run('sudo apt-get install -y cowsay')
    sudo = { exitCode: 0, stderr: '' }
  } catch (e) {
    sudo = { exitCode: e.exitCode, stderr: e.stderr ?? String(e) }
  }
  const otherSees = await outcome(() => other.files.read('data.csv'))
  console.log(JSON.stringify({
    rows: rows.logs.stdout.join('').trim(),
    read,
    viaWorkspace,
    pwd: pwd.stdout,
    whoami: whoami.stdout,
    tmp: tmp.stdout,
    tmpKernel: tmpKernel.logs.stdout.join('').trim(),
    ctxCwd: ctxCwd.logs.stdout.join('').trim(),
    cmdCwd: cmdCwd.stdout,
    missingCwd,
    sudo,
    otherSees: otherSees.startsWith('refused') ? 'refused' : otherSees,
  }))
} finally {
  await sbx.kill().catch(() => {})
  await other.kill().catch(() => {})
}
