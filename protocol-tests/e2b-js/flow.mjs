// E2B's JavaScript SDK (pinned in package.json) against the broker, as an E2B user's code
// would run it: only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY are set. Run by
// protocol-tests/test_e2b.py; prints one JSON line of what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create()
try {
  await sbx.runCode('x = 40')
  const sum = await sbx.runCode('x + 2')
  const chart = await sbx.runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()'
  )
  const png = chart.results.find((r) => r.png)?.png ?? ''
  const sig = Buffer.from(png, 'base64').subarray(0, 8)
  await sbx.files.write('js.txt', 'hello from js')
  const file = await sbx.files.read('js.txt')
  const cmd = await sbx.commands.run('echo js-cmd')
  const killed = await sbx.kill()
  console.log(JSON.stringify({
    sum: sum.text,
    png: sig.equals(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])),
    file,
    cmd: cmd.stdout,
    killed,
  }))
} catch (e) {
  await sbx.kill().catch(() => {})
  throw e
}
