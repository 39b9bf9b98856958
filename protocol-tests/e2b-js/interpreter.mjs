// E2B's JavaScript SDK (pinned in package.json): the code interpreter's results as an E2B
// user's code reads them (text, result.chart, result.data, PIL display, runCode's envs).
// Run by protocol-tests/test_e2b_interpreter.py; prints one JSON line of what it saw.
import { Sandbox } from '@e2b/code-interpreter'

const PNG = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
const isPng = (b64) => Buffer.from(b64 ?? '', 'base64').subarray(0, 8).equals(PNG)

const sbx = await Sandbox.create()
try {
  const text = (await sbx.runCode("'abc'")).text
  const int = (await sbx.runCode('1 + 1')).text
  const none = (await sbx.runCode('None')).results.length
  const json = (await sbx.runCode("{'k': [1, 2]}")).results[0]?.json ?? null

  const bar = await sbx.runCode(
    "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 3])\nplt.title('T')\nplt.show()"
  )
  const line = await sbx.runCode(
    "import matplotlib.pyplot as plt\nplt.plot(['x', 'y', 'z'], [1, 2, 3])\nplt.show()"
  )
  const frame = await sbx.runCode(
    "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"
  )
  const pil = await sbx.runCode(
    "from PIL import Image\nImage.new('RGB', (4, 4), 'blue').show()"
  )
  const envInside = (await sbx.runCode("import os\nos.environ['KB_JS']", { envs: { KB_JS: 'js-value' } })).text
  const envAfter = (await sbx.runCode("import os\nos.environ.get('KB_JS')")).results.length
  let badEnv = 'returned'
  try {
    await sbx.runCode('1', { envs: { LD_PRELOAD: '/tmp/x.so' } })
  } catch (e) {
    badEnv = `${e.name}: ${e.message}`
  }
  // Contexts are listed with the working directory each was created with.
  const tmpCtx = await sbx.createCodeContext({ cwd: '/tmp' })
  const contexts = (await sbx.listCodeContexts()).map((c) => [c.id === tmpCtx.id, c.cwd])
  await sbx.kill()
  console.log(JSON.stringify({
    text,
    int,
    none,
    json,
    chart: bar.results[0]?.chart ?? null,
    chartPng: isPng(bar.results[0]?.png),
    figureResults: bar.results.length,
    line: line.results[0]?.chart ?? null,
    data: frame.results[0]?.data ?? null,
    pil: pil.results.length === 1 && isPng(pil.results[0].png),
    envInside,
    envAfter,
    badEnv,
    contexts,
  }))
} catch (e) {
  await sbx.kill().catch(() => {})
  throw e
}
